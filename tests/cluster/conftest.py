"""The cluster tier: one `make cluster` (CeleryExecutor on Postgres + Redis, two workers) per
test session, driven as its users drive it: REST over HTTP with a signed-in token, the `airflow`
and `eagle3-data` CLIs with the env file it prints, and a browser.

The cluster is started the way `make cluster` starts it (the launcher as a child process), so
the session also checks what a person relies on: the printed env file works, and SIGTERM to the
launcher leaves nothing behind (test_zz_shutdown.py runs last).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from functools import cached_property
from pathlib import Path

import httpx
import pytest
from eagle3_airflow import DAG_ID

from eagle3_data.config import deep_merge, load_config
from eagle3_data.dev.processes import local_http
from eagle3_devtools.cluster import ADMIN_USER, CLUSTER_OVERRIDES, ApiClient
from eagle3_devtools.services import kill_group, reap_leftovers
from eagle3_devtools.stack import SAMPLE_DATA
from tests.hang_report import watch_logs


def deep_merged(base: dict, overrides: dict) -> dict:
    out = json.loads(json.dumps(base))
    deep_merge(out, overrides)
    return out


REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 600  # start-up on a loaded 2-core machine: a deadline, not a measurement
RUN_TIMEOUT_S = 600
# make cluster's small generations, checkpointed every 8 samples and 4 at a time (so a worker
# killed mid-stage has committed parts to resume from), and a dataset whose dev outputs have
# split BPE (so a strict gate fails: the browser test's failed run).
CONFIG_OVERRIDES = deep_merged(
    CLUSTER_OVERRIDES,
    {
        "generation": {"local": {"rows_per_part": 8, "in_flight_per_endpoint": 4}},
        "datasets": [{"name": "tool_calls", "dev": {"bpe_split_rate": 0.3}}, {"name": "code"}, {"name": "chat"}],
    },
)


# The test tier's Airflow timings: the DAG file does not change during a session, so the
# dag-processor parses it once at start instead of every 2 min (a parse costs a core for
# seconds, at the expense of the runs; `make cluster` keeps re-parsing for people editing it).
TEST_AIRFLOW_ENV = {
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "3600",
}


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


@dataclass
class ClusterHandle:
    launcher: subprocess.Popen
    workdir: Path
    env_file: Path
    env: dict[str, str] = field(repr=False)  # os.environ + the env file: for CLI subprocesses
    password: str = field(repr=False)
    log: Path = field(default=Path())

    @property
    def base(self) -> str:
        return self.env["AIRFLOW__API__BASE_URL"]

    @cached_property
    def client(self) -> ApiClient:
        return ApiClient(self.base, ADMIN_USER, self.password)

    def token(self) -> str:
        return self.client.token()

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        return self.client.request(method, path, timeout=60, **kw)

    def trigger(self, run_id: str, logical_date: str | None, conf: dict) -> httpx.Response:
        return self.api(
            "POST", f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": logical_date, "conf": conf}
        )

    def run(self, run_id: str) -> dict:
        r = self.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def runs(self) -> list[dict]:
        return self.api("GET", f"/dags/{DAG_ID}/dagRuns", params={"limit": 100}).json()["dag_runs"]

    def wait_run(self, run_id: str, timeout: float = RUN_TIMEOUT_S) -> str:
        """The run's final state (success/failed); fails the test at the deadline."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            state = self.run(run_id)["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(1)
        pytest.fail(f"run {run_id} still {state} after {timeout:.0f} s: {self.task_states(run_id)}")

    def task_instances(self, run_id: str) -> list[dict]:
        r = self.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 500})
        assert r.status_code == 200, r.text
        return r.json()["task_instances"]

    def task_states(self, run_id: str) -> dict[str, str]:
        return {
            f"{t['task_id']}[{t['rendered_map_index'] or t['map_index']}]": t["state"]
            for t in self.task_instances(run_id)
        }

    def task_log(self, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        r = self.api(
            "GET",
            f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"map_index": map_index, "full_content": True},
            headers={"Accept": "application/json"},
        )
        assert r.status_code == 200, r.text
        return json.dumps(r.json()["content"])

    def cli(self, *argv: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.workdir
        )
        if check:
            assert out.returncode == 0, f"{argv} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    def airflow(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.cli(str(BIN / "airflow"), *args, **kw)

    def eagle3(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.cli(str(BIN / "eagle3-data"), *args, **kw)

    def s3(self):
        from eagle3_data.storage import s3_client

        return s3_client(
            self.env["AWS_ENDPOINT_URL"],
            access_key=self.env["AWS_ACCESS_KEY_ID"],
            secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def etags(self, bucket: str, prefix: str) -> dict[str, str]:
        """Every artifact object under `prefix` by ETag. Not the stages' `_lease*.json`: a
        writer's lock record, rewritten by every attempt that takes the stage, also one that
        then reuses it (docs/storage.md, "One writer per stage")."""
        from eagle3_data.storage.lease import is_lease

        out = {}
        for page in self.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.update(
                {o["Key"]: o["ETag"] for o in page.get("Contents", []) if not is_lease(o["Key"].rsplit("/", 1)[-1])}
            )
        return out

    def dev_stats(self) -> dict:
        return local_http().get(f"{self.env['EAGLE3_DEV_SERVER_URL']}/dev/stats", timeout=30).json()

    def generation_requests(self) -> int:
        return sum(sum(per_key.values()) for per_key in self.dev_stats()["requests"].values())

    def services(self) -> dict[str, dict]:
        return json.loads((self.workdir / "services.json").read_text())

    def check_alive(self) -> None:
        if self.launcher.poll() is not None:
            pytest.fail(f"the cluster launcher exited with {self.launcher.returncode}: {self.log.read_text()[-3000:]}")


def _term_with_parent() -> None:
    """The launcher gets SIGTERM (and so stops the cluster) if this pytest process dies first."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ClusterHandle:
    root = tmp_path_factory.mktemp("cluster")
    work, ready, log = root / "w", root / "ready", root / "launcher.log"
    watch_logs(root)  # services' and every task attempt's logs, into a timed-out test's report
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "include"), os.environ.get("PYTHONPATH")) if p),
    }
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eagle3_devtools.cluster",
                "--workdir",
                str(work),
                "--ready-file",
                str(ready),
                "--config-overrides",
                json.dumps(CONFIG_OVERRIDES),
                "--airflow-env",
                json.dumps(TEST_AIRFLOW_ENV),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_term_with_parent,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if launcher.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"make cluster did not come up (exit {launcher.poll()}):\n{log.read_text()[-4000:]}")
            time.sleep(1)
        env_file = Path(ready.read_text())
        cluster_env = {**os.environ, **read_env_file(env_file)}
        cluster_env.pop("PYTHONPATH", None)  # the CLIs as a user runs them: no checkout on the path
        password = json.loads((work / "passwords.json").read_text())["admin"]
        handle = ClusterHandle(launcher, work, env_file, cluster_env, password, log)
        r = handle.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
        assert r.status_code == 200, r.text
        fail_the_catch_up_run(handle)
        yield handle
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(180)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        reap_leftovers(work / "services.json")  # a launcher that could not clean up: its services


def fail_the_catch_up_run(cluster: ClusterHandle, timeout: float = 120) -> None:
    """A daily DAG unpaused within 2.4 h after midnight UTC gets a run for that midnight at once
    (catchup is off, but Airflow's CronTriggerTimetable, run_immediately=False, still takes the
    past tick within a tenth of the interval: apache/airflow#64162), later in the day none. No test
    reads that run, and with `max_active_runs=1` the first triggered run waited behind its whole
    pipeline on today's prompts (the killed run's setup 257-305 s instead of 131-190 s,
    seen in a `make test` cluster run, 2026-12-05). When the DAG says it is due, it is marked
    failed as it appears, as a person who does not want it would in the UI."""
    due = cluster.api("GET", f"/dags/{DAG_ID}").json()["next_dagrun_run_after"]
    if due is None or datetime.fromisoformat(due) > datetime.now(timezone.utc):
        return
    deadline = time.monotonic() + timeout
    while not (runs := [r for r in cluster.runs() if r["run_type"] == "scheduled"]):
        assert time.monotonic() < deadline, f"no run for {due} {timeout:.0f} s after unpausing: {cluster.runs()}"
        cluster.check_alive()
        time.sleep(0.5)
    for run in runs:
        r = cluster.api("PATCH", f"/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}", json={"state": "failed"})
        assert r.status_code == 200, r.text


SMALL = 8  # prompts per dataset where a workflow needs a few samples, not the whole sample file


def upload(cluster: ClusterHandle, dataset: str, day: date, rows: int | None = None) -> None:
    """The sample file (or its first `rows` prompts: each sample costs generation, validation
    and hidden states CPU on a two-core CI machine) as the `day` partition, with the command a
    person uses before a backfill."""
    src = SAMPLE_DATA / f"{dataset}.jsonl"
    if rows is not None:
        lines = src.read_text().splitlines(keepends=True)[:rows]
        src = cluster.workdir.parent / f"first-{rows}" / src.name
        src.parent.mkdir(exist_ok=True)
        src.write_text("".join(lines))
    out = cluster.eagle3("prompts", "upload", "--dataset", dataset, "--date", f"{day}", str(src))
    assert f"date={day}/{dataset}.jsonl" in out.stdout


def config(cluster: ClusterHandle):
    return load_config(cluster.env["EAGLE3_CONFIG"])


def run_prefix(cluster: ClusterHandle, day: date) -> tuple[str, str]:
    storage = config(cluster).storage
    return storage.bucket, f"{storage.prefix}/runs/date={day}/"


KILLED = date(2026, 11, 4)
KILLED_RUN = "killed"
STRICT = {"max_bpe_mismatch_rate": 0.0}  # tool_calls' dev outputs have split BPE: this gate fails


@pytest.fixture(scope="session")
def killed_run(cluster) -> dict:
    """A run whose gpu worker is SIGKILLed (its whole process group, as `kill -9 -<pgid>` or a
    container runtime would) once generate_local has committed a part; the launcher starts a
    replacement worker. The task runner is in a group of its own (Airflow >= 3.2) and would
    outlive the kill but for plugins/supervisor_guard.py, which ends it with its supervisor, so
    that the retry resumes the stage. Its strict gate then fails: it is also the failed run the
    browser test opens."""
    from eagle3_data.storage import ArtifactStore, StageRef

    cfg = config(cluster)
    upload(cluster, "tool_calls", KILLED)
    upload(cluster, "code", KILLED, rows=SMALL)
    dev = httpx.post(
        f"{cluster.env['EAGLE3_DEV_SERVER_URL']}/dev/config",
        timeout=30,
        json={
            "datasets": {d.name: {"noncanonical_rate": d.dev_bpe_split_rate} for d in cfg.datasets},
            "endpoints": {"generate": {"latency": {"dist": "fixed", "mean": 1.0}}},
        },
    )
    assert dev.status_code == 200, dev.text  # slow generation: the kill lands mid-stage
    # code passes the strict gate, so merge has data and publish writes the run report (a run in
    # which every dataset fails stops at merge, before any report index exists).
    r = cluster.trigger(
        KILLED_RUN, f"{KILLED}T00:00:00Z", {"datasets": ["tool_calls", "code"], "skip_hidden_states": True, **STRICT}
    )
    assert r.status_code == 200, r.text
    store = ArtifactStore(cluster.s3(), cfg.storage.bucket, cfg.storage.prefix)
    ref = StageRef(f"date={KILLED}", "generate_local", "tool_calls")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not [o for o in store.list_objects(store.key(ref)) if "/_progress/part-" in o["Key"]]:  # a committed part
        assert time.monotonic() < deadline, cluster.task_states(KILLED_RUN)
        cluster.check_alive()
        time.sleep(0.5)
    # Map index 0: tool_calls comes first in the run's datasets (the name is rendered only once
    # the instance has finished).
    ti = next(
        t
        for t in cluster.task_instances(KILLED_RUN)
        if t["task_id"] == "dataset.generate_local" and t["map_index"] == 0
    )
    assert ti["state"] == "running" and ti["hostname"] == "gpu-worker", ti
    kill_group(cluster.services()["worker-gpu"]["pgid"], signal.SIGKILL, grace=0)
    state = cluster.wait_run(KILLED_RUN)
    httpx.post(
        f"{cluster.env['EAGLE3_DEV_SERVER_URL']}/dev/config",
        timeout=30,
        json={"datasets": {d.name: {"noncanonical_rate": d.dev_bpe_split_rate} for d in cfg.datasets}},
    )
    return {"state": state, "store": store, "date": KILLED}
