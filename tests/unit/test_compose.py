"""docker-compose.yaml and docker/ agree with the code they deploy.

No Docker engine runs here, so this checks what can go wrong silently: a connection id, queue or
pool named differently from the DAG's, a secret with a default, a worker nobody feeds, a GPU
worker without a GPU. Compose's own `${VAR...}` interpolation is re-implemented for the subset
the file uses, with the values of .env.example.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from eagle3_airflow import AWS_CONN_ID, DAG_ID, GPU_QUEUE, OPENROUTER_CONN_ID, OPENROUTER_POOL, SGLANG_CONN_ID

from eagle3_data.config import load_config

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_SERVICES = {
    "airflow-init",
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker",
    "airflow-worker-gpu",
}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(Exception):
    pass


def interpolate(value, env: dict[str, str]):
    """Compose's interpolation: ${V}, ${V:-default}, ${V-default}, ${V:?error}, ${V?error}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name, op, arg = m[1] or m[4], m[2], m[3]
        val = env.get(name)
        unset = val is None or (val == "" and op and op.startswith(":"))
        if op in (":?", "?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return val or ""

    return _VAR.sub(sub, value)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, val = line.partition("=")
            env[key.strip()] = val.strip()
    return env


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


@pytest.fixture(scope="module")
def example_env():
    return read_env_file(REPO / ".env.example")


@pytest.fixture(scope="module")
def filled_env(example_env):
    """.env.example with every empty secret filled as the comment there says (hex)."""
    return {k: v or f"{k.lower()}-0123abcd" for k, v in example_env.items()}


@pytest.fixture(scope="module")
def compose(raw, filled_env):
    return interpolate(raw, filled_env)


def test_secrets_have_no_defaults(raw, example_env):
    """Starting without a filled .env stops with the variable's name, not with a weak default."""
    with pytest.raises(
        MissingVariable,
        match=r"^(AIRFLOW_FERNET_KEY|AIRFLOW_JWT_SECRET|AIRFLOW_API_SECRET_KEY|POSTGRES_PASSWORD|S3_ACCESS_KEY"
        r"|S3_SECRET_KEY|AIRFLOW_ADMIN_PASSWORD): set",
    ):
        interpolate(raw, {k: v for k, v in example_env.items() if v and k != "AIRFLOW_ADMIN_PASSWORD"})
    text = (REPO / "docker-compose.yaml").read_text()
    for secret in (
        "AIRFLOW_FERNET_KEY",
        "AIRFLOW_JWT_SECRET",
        "POSTGRES_PASSWORD",
        "S3_SECRET_KEY",
        "AIRFLOW_ADMIN_PASSWORD",
    ):
        assert set(re.findall(r"\$\{" + secret + r"(:?[-?]|\})", text)) == {":?"}, secret  # required everywhere
    used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text))
    assert used <= set(example_env), f"variables missing from .env.example: {used - set(example_env)}"
    assert ".env" in (REPO / ".gitignore").read_text().split()


def test_services_and_executor(compose):
    services = compose["services"]
    assert AIRFLOW_SERVICES | {"postgres", "redis", "s3", "sglang"} <= set(services)
    for name in AIRFLOW_SERVICES:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        # all-admins mode signs every request in as admin: the report view would be public
        assert env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "false").lower() == "false"
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
    assert services["airflow-init"]["depends_on"].keys() == {"postgres", "redis", "s3"}  # not itself
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        assert services[name]["depends_on"]["airflow-init"] == {"condition": "service_completed_successfully"}
    assert services["airflow-apiserver"]["ports"] == ["127.0.0.1:8080:8080"]


def _queues(service: dict) -> set[str]:
    cmd = service["command"]
    return set(cmd[cmd.index("--queues") + 1].split(","))


def _gpu_reservation(service: dict) -> list[dict]:
    return [
        d
        for d in service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
    ]


def test_workers_serve_every_queue_and_pool_of_the_dag(compose):
    """Every task's queue has a worker (GPU queue on a GPU worker) and every pool is created."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    tasks = bag.dags[DAG_ID].tasks
    services = compose["services"]
    assert _queues(services["airflow-worker-gpu"]) == {GPU_QUEUE}
    assert _gpu_reservation(services["airflow-worker-gpu"]) and not _gpu_reservation(services["airflow-worker"])
    assert GPU_QUEUE not in _queues(services["airflow-worker"])
    served = _queues(services["airflow-worker"]) | _queues(services["airflow-worker-gpu"])
    used_queues = {t.queue for t in tasks}
    assert GPU_QUEUE in used_queues and used_queues <= served

    init = (REPO / "docker" / "init.sh").read_text()
    created = set(re.findall(r"^airflow pools set (\S+) ", init, re.M))
    used_pools = {t.pool for t in tasks} - {"default_pool"}
    assert used_pools == {OPENROUTER_POOL} and used_pools <= created
    assert "exec /entrypoint bash /opt/airflow/docker/init.sh" in services["airflow-init"]["command"][-1]


def test_connections_match_the_code(compose, filled_env):
    env = compose["services"]["airflow-scheduler"]["environment"]
    conns = {k[len("AIRFLOW_CONN_") :].lower(): json.loads(v) for k, v in env.items() if k.startswith("AIRFLOW_CONN_")}
    assert set(conns) == {AWS_CONN_ID, OPENROUTER_CONN_ID, SGLANG_CONN_ID}

    aws = conns[AWS_CONN_ID]
    assert aws["conn_type"] == "aws"
    assert (aws["login"], aws["password"]) == (filled_env["S3_ACCESS_KEY"], filled_env["S3_SECRET_KEY"])
    s3 = compose["services"]["s3"]
    assert s3["environment"] == {"AWS_ACCESS_KEY_ID": aws["login"], "AWS_SECRET_ACCESS_KEY": aws["password"]}
    assert aws["extra"]["endpoint_url"] == "http://s3:8333" and "-s3.port=8333" in s3["command"]

    openrouter = conns[OPENROUTER_CONN_ID]
    assert openrouter["host"].startswith("https://openrouter.ai/")
    assert openrouter["password"] == filled_env["OPENROUTER_API_KEY"]

    sglang = compose["services"]["sglang"]["command"]
    port = sglang[sglang.index("--port") + 1]
    assert conns[SGLANG_CONN_ID]["extra"]["endpoints"] == f"http://sglang:{port}"


def test_sglang_server(compose):
    svc = compose["services"]["sglang"]
    cmd = svc["command"]
    assert svc["profiles"] == ["gpu"] and _gpu_reservation(svc)
    assert "--enable-return-hidden-states" in cmd
    assert cmd[cmd.index("--reasoning-parser") + 1] == "kimi_k2"
    assert cmd[cmd.index("--tool-call-parser") + 1] == "kimi_k2"
    assert cmd[cmd.index("--model-path") + 1] == load_config().model.name


def test_dockerfile_matches_requirements_and_layout():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    pins = dict(
        line.split("==")
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    base = re.search(r"^ARG AIRFLOW_IMAGE=apache/airflow:(\S+)-python(\S+)$", dockerfile, re.M)
    assert base and base[1] == pins["apache-airflow"] and base[2] == "3.11"
    assert "-r /tmp/eagle3/requirements.txt" in dockerfile and '"apache-airflow==${AIRFLOW_VERSION}"' in dockerfile
    for folder in ("dags", "plugins", "include"):
        assert re.search(rf"^COPY --chown=airflow:0 {folder} /opt/airflow/{folder}$", dockerfile, re.M), folder
    for folder in ("dags", "plugins", "include", "docker"):
        assert (REPO / folder).is_dir()
    assert (REPO / "docker" / "init.sh").stat().st_mode & 0o111  # executable
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".env", ".git"} <= set(ignored)


def test_bucket_comes_from_the_pipeline_config(compose):
    """init.sh creates the bucket the pipeline config names, through the same connection."""
    init = (REPO / "docker" / "init.sh").read_text()
    assert "load_config().storage" in init and "init_bucket()" in init and "AWS_CONN_ID" in init
    mount = compose["services"]["airflow-scheduler"]["volumes"][0]
    assert mount.endswith(":/opt/airflow/include/config/pipeline.yaml:ro")
    assert load_config(REPO / mount.split(":")[0]).storage.bucket  # the mounted default parses
