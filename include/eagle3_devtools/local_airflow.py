"""`make airflow`: a local Airflow UI on 127.0.0.1 against the embedded services.

Runs api-server, scheduler and dag-processor as separate processes (not `airflow standalone`,
which binds log servers on all interfaces), with LocalExecutor on SQLite, the `openrouter` pool,
and the same stack as `make demo` (SeaweedFS, dev inference server, tiny model). The sample
datasets are uploaded as today's prompt partition, so triggering the DAG from the UI works at
once. Ctrl-C, SIGTERM and SIGHUP stop everything started here, process groups included
(see services.py); the S3 keys and an env file to `source` are printed like `make cluster`'s.
Auth is on, as in `make cluster` and production: one user `admin` with a random password (in the
env file as EAGLE3_UI_PASSWORD, and in passwords.json, both 0600; never printed), so the
validation-report tab is for signed-in users as docs/ui.md says (no all-admins shortcut, which
signs every request in).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from eagle3_airflow import DAG_ID, OPENROUTER_POOL

from eagle3_data.config import load_config
from eagle3_data.dev.processes import free_port, wait_http_ok
from eagle3_devtools.cluster import airflow_cmd, env_file_keys, run_airflow, write_env_file
from eagle3_devtools.services import Services, reap_leftovers, run_launcher
from eagle3_devtools.stack import REPO, airflow_db_migrate, airflow_env, dev_stack, upload_prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make airflow", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "demo-output" / "airflow-ui")
    parser.add_argument("--port", type=int, default=None, help="api-server port (default: a free one)")
    args = parser.parse_args(argv)
    return run_launcher("airflow", lambda: _serve(args.workdir.resolve(), args.port or free_port()))


def _serve(work: Path, port: int) -> int:
    left = reap_leftovers(work / "services.json")
    if left:
        print(f"airflow: stopped leftovers of a previous start: {', '.join(left)}", file=sys.stderr, flush=True)
    with dev_stack(work) as stack, Services(work / "logs", work / "services.json") as svc:
        password, passwords = secrets.token_urlsafe(12), work / "passwords.json"
        passwords.write_text(json.dumps({"admin": password}))
        passwords.chmod(0o600)
        env = {
            **os.environ,
            **stack.env,
            **airflow_env(work / "home"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AWS_ACCESS_KEY_ID": stack.s3.access_key,
            "AWS_SECRET_ACCESS_KEY": stack.s3.secret_key,
            "AWS_ENDPOINT_URL": stack.s3_endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "EAGLE3_DEV_SERVER_URL": stack.inference_url,
            # auth on: a password user, no all-admins shortcut (it would make the report tab public)
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "EAGLE3_UI_PASSWORD": password,
        }
        airflow_db_migrate(env)
        run_airflow(env, "pools", "set", OPENROUTER_POOL, "4", "OpenRouter concurrency")
        upload_prompts(stack.client(), load_config(stack.config_path), f"{datetime.now(timezone.utc):%Y-%m-%d}")
        svc.start("api-server", airflow_cmd("api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"), env)
        svc.start("scheduler", airflow_cmd("scheduler", "--skip-serve-logs"), env)
        svc.start("dag-processor", airflow_cmd("dag-processor"), env)
        wait_http_ok(
            f"http://127.0.0.1:{port}/api/v2/monitor/health", svc.procs(), "an Airflow process", svc.log_dir, 180
        )
        env_file = write_env_file(work / "airflow.env", env, env_file_keys(env))
        print(
            f"\nAirflow UI: http://127.0.0.1:{port}  sign in as admin, password: EAGLE3_UI_PASSWORD in the env file "
            f"below (or {passwords})\n"
            f"DAG {DAG_ID} is paused: unpause it, then Trigger (the form shows the params).\n"
            f"S3 (SeaweedFS): {stack.s3_endpoint}  access key {stack.s3.access_key}  secret key {stack.s3.secret_key}\n"
            f"Dev inference server: {stack.inference_url}\n"
            f"Env for the CLI, boto3 and airflow:  source {env_file}\n"
            f"Logs: {svc.log_dir}. Ctrl-C (or SIGTERM/SIGHUP) stops everything.",
            flush=True,
        )
        while not svc.dead():
            time.sleep(1)
        print(f"stopped: {', '.join(svc.dead())} exited (see {svc.log_dir})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
