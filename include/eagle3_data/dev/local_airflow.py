"""`make airflow`: a local Airflow UI on 127.0.0.1 against the embedded services.

Runs api-server, scheduler and dag-processor as separate processes (not `airflow standalone`,
which binds log servers on all interfaces), with LocalExecutor on SQLite, the `openrouter` pool,
and the same stack as `make demo` (SeaweedFS, dev inference server, tiny model). The sample
datasets are uploaded as today's prompt partition, so triggering the DAG from the UI works at
once. Ctrl-C stops everything started here, by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from eagle3_data.config import DAG_ID, OPENROUTER_POOL, load_config
from eagle3_data.dev.processes import free_port, wait_http_ok
from eagle3_data.dev.stack import REPO, airflow_db_migrate, airflow_env, dev_stack, upload_prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make airflow", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "demo-output" / "airflow-ui")
    parser.add_argument("--port", type=int, default=None, help="api-server port (default: a free one)")
    args = parser.parse_args(argv)
    work = args.workdir.resolve()
    port = args.port or free_port()
    bin_dir = Path(sys.executable).parent
    procs: list[subprocess.Popen] = []
    with dev_stack(work) as stack:
        env = {
            **os.environ,
            **stack.env,
            **airflow_env(work / "home"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        }
        airflow_db_migrate(env)
        subprocess.run([str(bin_dir / "airflow"), "pools", "set", OPENROUTER_POOL, "4", "OpenRouter concurrency"],
                       env=env, check=True, capture_output=True)
        upload_prompts(stack.client(), load_config(stack.config_path), f"{datetime.now(timezone.utc):%Y-%m-%d}")
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        commands = {
            "api-server": ["api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"],
            "scheduler": ["scheduler", "--skip-serve-logs"],
            "dag-processor": ["dag-processor"],
        }
        try:
            for name, cmd in commands.items():
                out = open(logs / f"{name}.log", "ab")
                procs.append(subprocess.Popen([str(bin_dir / "airflow"), *cmd], env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            wait_http_ok(f"http://127.0.0.1:{port}/api/v2/monitor/health", procs, "an Airflow process", logs, 180)
            print(
                f"\nAirflow UI: http://127.0.0.1:{port}  (login: none needed, every user is admin on this local setup)\n"
                f"DAG {DAG_ID} is paused: unpause it, then Trigger (the form shows the params).\n"
                f"S3 (SeaweedFS): {stack.s3_endpoint}; dev inference server: {stack.inference_url}\n"
                f"Logs: {logs}. Ctrl-C stops everything.",
                flush=True,
            )
            while all(p.poll() is None for p in procs):
                time.sleep(1)
            dead = [name for name, p in zip(commands, procs) if p.poll() is not None]
            print(f"stopped: {', '.join(dead)} exited (see {logs})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
            return 0
        finally:
            for p in procs:
                _stop_group(p)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we created (workers it forked included), SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
