"""docker-compose.yaml (the production recipe) and `make cluster` (the same shape on one machine)
agree: executor, broker and result backend, the Airflow processes, the queues and their workers,
the pool, the connections, and the environment variable names.

Both sides are read, nothing is started: the cluster's env comes from the functions the
launcher uses, with placeholder ports and keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import yaml
from eagle3_airflow import GPU_QUEUE, OPENROUTER_POOL

from eagle3_devtools import cluster
from eagle3_devtools.stack import DevStack, stack_env

REPO = Path(__file__).resolve().parents[2]
# Deliberate differences, each with its reason:
NOT_IN_CLUSTER = {
    "AIRFLOW__CORE__AUTH_MANAGER",  # compose: FAB (users in Postgres); cluster: SimpleAuthManager (no FAB install)
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


@pytest.fixture(scope="module")
def compose_env(compose) -> dict[str, str]:
    return compose["x-airflow-common"]["environment"]


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("cluster")
    env = stack_env(
        work,
        work / "pipeline.yaml",
        s3_endpoint="http://127.0.0.1:1",
        access_key="k",
        secret_key="s",
        inference_port=2,
        inference_url="http://127.0.0.1:2",
    )
    stack = DevStack(
        work,
        work / "pipeline.yaml",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        env,
        SimpleNamespace(access_key="k", secret_key="s"),
    )
    return cluster.cluster_env(
        work, stack, api_port=3, pg_port=4, pg_password="p", redis_port=5, passwords_file=work / "pw.json"
    )


def _scheme(url: str) -> str:
    return urlsplit(url).scheme


def test_executor_broker_backend_and_database(compose, compose_env, cluster_env):
    assert compose_env["AIRFLOW__CORE__EXECUTOR"] == cluster_env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    for key in (
        "AIRFLOW__CELERY__BROKER_URL",
        "AIRFLOW__CELERY__RESULT_BACKEND",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    ):
        assert _scheme(compose_env[key]) == _scheme(cluster_env[key]), key
    assert {"postgres", "redis"} <= set(compose["services"])


def test_same_environment_names(compose_env, cluster_env):
    missing = set(compose_env) - set(cluster_env) - NOT_IN_CLUSTER
    assert missing == set(), f"compose sets these, make cluster does not: {sorted(missing)}"
    for key in (
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK",
        "AIRFLOW__CORE__LOAD_EXAMPLES",
    ):
        assert str(compose_env[key]).lower() == str(cluster_env[key]).lower(), key


def test_same_connections(compose_env, cluster_env):
    conns = lambda env: {k for k in env if k.startswith("AIRFLOW_CONN_")}
    assert conns(compose_env) == conns(cluster_env) != set()
    for key in conns(compose_env):
        compose_type = re.search(r'"conn_type":\s*"(\w+)"', compose_env[key])[1]
        assert compose_type == json.loads(cluster_env[key])["conn_type"], key


def _compose_command(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd.split() if isinstance(cmd, str) else list(cmd)


def test_same_airflow_processes_and_queues(compose):
    services = cluster.airflow_services(8080, cluster.DEFAULT_CONCURRENCY)
    compose_cmds = [
        _compose_command(s) for n, s in compose["services"].items() if n.startswith("airflow-") and n != "airflow-init"
    ]
    ours = [argv[1:] for argv in services.values()]
    assert sorted(c[0] for c in compose_cmds) == sorted(c[0] for c in ours)  # api-server, scheduler, ..., celery x2
    queues = lambda cmds: sorted(c[c.index("--queues") + 1] for c in cmds if c[:2] == ["celery", "worker"])
    assert queues(compose_cmds) == queues(ours) == sorted(cluster.QUEUES) == sorted(["default", GPU_QUEUE])
    gpu = next(c for c in compose_cmds if "--queues" in c and c[c.index("--queues") + 1] == GPU_QUEUE)
    assert re.fullmatch(r"\$\{GPU_WORKER_CONCURRENCY:-(\d+)\}", gpu[gpu.index("--concurrency") + 1])[1] == str(
        cluster.DEFAULT_CONCURRENCY[GPU_QUEUE]
    )


def test_same_pool():
    init = (REPO / "docker" / "init.sh").read_text()
    m = re.search(r'airflow pools set (\w+) "\$\{OPENROUTER_POOL_SLOTS:-(\d+)\}"', init)
    assert m and m[1] == OPENROUTER_POOL and int(m[2]) == cluster.OPENROUTER_POOL_SLOTS
