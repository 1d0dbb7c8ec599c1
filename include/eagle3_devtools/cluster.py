"""`make cluster`: the production shape of docker-compose.yaml on one machine, loopback only.

CeleryExecutor on Postgres (metadata DB and Celery result backend) and Redis (broker), with the
same processes as the compose file: api-server, scheduler, dag-processor, triggerer, and two
Celery workers, one for queue `default` and one for queue `gpu` (local generation and hidden
states). SeaweedFS and the dev inference server stand in for S3 and the engines, as in `make
airflow`. Postgres and Redis are the Debian packages (`make cluster` apt-installs them when
missing), run as our own processes on fresh data dirs and free 127.0.0.1 ports; Postgres runs as
the non-root `postgres` user when we are root (it refuses to run as root).

It prints the UI URL, the credentials, and an env file to `source` so that `airflow`, boto3 and
`eagle3-data` reach this cluster. Ctrl-C, SIGTERM and SIGHUP stop everything (see services.py);
a start on the same work dir first removes whatever a SIGKILLed launcher left behind. A Celery
worker that dies is started again, as compose's `restart: always` would.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from eagle3_airflow import DAG_ID, GPU_QUEUE, OPENROUTER_POOL

from eagle3_data.config import load_config
from eagle3_data.dev.processes import free_port, http_ok, local_http
from eagle3_data.errors import UserError
from eagle3_devtools.services import Service, Services, reap_leftovers, run_launcher
from eagle3_devtools.stack import REPO, DevStack, airflow_env, dev_stack, upload_prompts

DEFAULT_QUEUE = "default"  # Airflow's [operators] default_queue: every task without queue=
QUEUES = (DEFAULT_QUEUE, GPU_QUEUE)
OPENROUTER_POOL_SLOTS = 256  # docker/init.sh's default (OPENROUTER_POOL_SLOTS)
ADMIN_USER = "admin"
SYSTEM_PACKAGES = ("postgresql", "redis-server", "chromium")
WORKER_HOSTNAME_ENV = "EAGLE3_WORKER_HOSTNAME"
# Small generations so a cluster run takes seconds on two cores; the shape of a real run.
CLUSTER_OVERRIDES = {
    "generation": {"sampling": {"max_new_tokens": 128}},
    "merge": {"max_length": 1024, "shard_tokens": 8192},
}


def worker_hostname() -> str:
    """[core] hostname_callable of the two workers: both run on this machine, so the task
    instances' `hostname` would otherwise not say which worker ran them."""
    return os.environ.get(WORKER_HOSTNAME_ENV) or socket.getfqdn()


def postgres_bin() -> Path:
    """The newest installed PostgreSQL server's bin dir (Debian keeps it off PATH)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    which = shutil.which("postgres")
    if which:
        return Path(which).parent
    raise UserError("PostgreSQL server not found: `apt-get install -y postgresql` (make cluster does it)")


def check_system_tools() -> None:
    missing = [
        p for p, ok in (("postgresql", _has_postgres()), ("redis-server", bool(shutil.which("redis-server")))) if not ok
    ]
    if missing:
        raise UserError(
            f"missing Debian packages: {' '.join(missing)}: `apt-get install -y {' '.join(SYSTEM_PACKAGES)}`"
        )


def _has_postgres() -> bool:
    try:
        postgres_bin()
        return True
    except UserError:
        return False


@dataclass
class Cluster:
    """A running cluster: what tests and people need to reach it."""

    workdir: Path
    api_url: str
    username: str
    password: str = field(repr=False)
    env: dict[str, str] = field(repr=False)  # full Airflow + S3 env (secrets): for subprocesses
    env_file: Path = field(default=Path())
    stack: DevStack | None = field(default=None, repr=False)
    services: Services | None = field(default=None, repr=False)


def _wait(check, what: str, svc: Services, timeout: float = 120.0, *, ignore: str | None = None) -> None:
    """Until `check()` holds; fail at once, naming it and quoting its log, when a service (but
    `ignore`) exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc.raise_if_dead(what, ignore=ignore)
        if check():
            return
        time.sleep(0.2)
    raise UserError(f"{what}: not ready within {timeout:.0f} s (logs: {svc.log_dir})")


def start_postgres(svc: Services, password: str, base: Path) -> int:
    """initdb in `base` (fresh, reachable by the postgres user) and run the server on a free
    loopback port; returns the port."""
    bindir = postgres_bin()
    user = "postgres" if os.geteuid() == 0 else None
    (base / "pwfile").write_text(password + "\n")
    if user:
        shutil.chown(base, user)
        shutil.chown(base / "pwfile", user)
    run_as = ["runuser", "-u", user, "--"] if user else []
    out = subprocess.run(
        [
            *run_as,
            str(bindir / "initdb"),
            "-D",
            str(base / "data"),
            "-U",
            "airflow",
            "-E",
            "UTF8",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={base / 'pwfile'}",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode:
        raise UserError(f"initdb failed: {out.stderr[-2000:]}")
    port = free_port()
    svc.start(  # stopped with SIGINT: Postgres' fast shutdown
        "postgres",
        [
            str(bindir / "postgres"),
            "-D",
            str(base / "data"),
            "-k",
            str(base),
            "-p",
            str(port),
            "-h",
            "127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
        ],
        dict(os.environ),
        user=user,
        stop_signal=signal.SIGINT,
        infrastructure=True,
    )
    ready = [*run_as, str(bindir / "pg_isready"), "-q", "-h", str(base), "-p", str(port)]
    _wait(lambda: subprocess.run(ready).returncode == 0, "postgres", svc, 60)
    out = subprocess.run(
        [*run_as, str(bindir / "createdb"), "-h", str(base), "-p", str(port), "-U", "airflow", "airflow"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode:
        raise UserError(f"createdb failed: {out.stderr[-2000:]}")
    return port


def start_redis(svc: Services, workdir: Path) -> int:
    port = free_port()
    data = workdir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    svc.start(
        "redis",
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
            "--protected-mode",
            "yes",
        ],
        dict(os.environ),
        infrastructure=True,
    )

    def ping() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    _wait(ping, "redis", svc, 30)
    return port


def cluster_env(
    work: Path, stack: DevStack, *, api_port: int, pg_port: int, pg_password: str, redis_port: int, passwords_file: Path
) -> dict[str, str]:
    """Everything the Airflow processes and the CLI need: docker-compose.yaml's variables with
    loopback addresses, plus this machine's AIRFLOW_HOME and folders."""
    from cryptography.fernet import Fernet

    db = f"airflow:{pg_password}@127.0.0.1:{pg_port}/airflow"
    env = {
        **database_env(work, pg_port=pg_port, pg_password=pg_password),
        **stack.env,
        "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql+psycopg2://{db}",
        "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "false",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "true",
        "AIRFLOW__CORE__PARALLELISM": "8",
        # Auth on, as in production: a password user, no all-admins shortcut.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file),
        # The scheduler's health server (compose's healthcheck) on loopback.
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "true",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST": "127.0.0.1",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
        # A worker that died is noticed in seconds, not the default 5 min: its tasks are retried.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "120",  # a re-parse costs a core for seconds
        # S3 for boto3 and `eagle3-data` (same keys as the aws_default connection).
        "AWS_ACCESS_KEY_ID": stack.s3.access_key,
        "AWS_SECRET_ACCESS_KEY": stack.s3.secret_key,
        "AWS_ENDPOINT_URL": stack.s3_endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "EAGLE3_DEV_SERVER_URL": stack.inference_url,
    }
    return env


def database_env(work: Path, *, pg_port: int, pg_password: str) -> dict[str, str]:
    """What `airflow db migrate` needs (this machine's AIRFLOW_HOME and the Postgres URL), so the
    migration can run while SeaweedFS and the dev server start."""
    return {
        **airflow_env(work / "home"),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:{pg_password}@127.0.0.1:{pg_port}/airflow",
    }


def write_env_file(path: Path, env: dict[str, str], keys: list[str]) -> Path:
    """`source`-able: exports the given keys (0600: it holds the S3 secret and the DB password)."""
    lines = ["# source me: the CLI, boto3 and `airflow` then reach this cluster"]
    lines += [f"export {k}={shlex.quote(env[k])}" for k in keys if k in env]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def env_file_keys(env: dict[str, str]) -> list[str]:
    prefixes = ("AIRFLOW_HOME", "AIRFLOW__", "AIRFLOW_CONN_", "AWS_", "EAGLE3_", "HF_", "TRANSFORMERS_")
    return sorted(k for k in env if k.startswith(prefixes))


def airflow_cmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "airflow"), *args]


def run_airflow(env: dict[str, str], *args: str, timeout: float = 600) -> str:
    out = subprocess.run(airflow_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise UserError(f"airflow {' '.join(args[:2])} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout


def finish_job(svc: Services, job: Service, timeout: float = 600) -> None:
    """Wait for a one-shot child (a migration, a CLI call) to end; fail with its log's tail if
    it did not succeed, or if a service died meanwhile. It is then no longer supervised."""
    _wait(lambda: job.proc.poll() is not None, job.name, svc, timeout, ignore=job.name)
    svc.forget(job.name)
    if job.proc.returncode:
        raise UserError(
            f"airflow {' '.join(job.argv[1:3])} failed (exit {job.proc.returncode}):\n"
            f"{job.log_path.read_text(errors='replace')[-2000:]}"
        )


@dataclass
class ApiClient:
    """The api-server's REST API as a signed-in user (a token from /auth/token, as the UI gets):
    the launcher's set-up calls and the cluster tests' calls both go through it."""

    base: str
    user: str
    password: str = field(repr=False)
    _token: str | None = field(default=None, repr=False)

    def token(self) -> str:
        """The user's JWT, signed in for once; a refused sign-in is a UserError with the answer."""
        if self._token is None:
            r = local_http().post(
                f"{self.base}/auth/token", json={"username": self.user, "password": self.password}, timeout=30
            )
            if r.status_code != 201:
                raise UserError(f"signing in as {self.user} at {self.base}/auth/token: {r.status_code} {r.text[:500]}")
            self._token = r.json()["access_token"]
        return self._token

    def request(self, method: str, path: str, *, headers: dict | None = None, timeout: float = 30, **kw):
        """`method` on /api/v2`path` with the token (and any `headers` beside it)."""
        headers = {"Authorization": f"Bearer {self.token()}", **(headers or {})}
        return local_http().request(method, f"{self.base}/api/v2{path}", headers=headers, timeout=timeout, **kw)

    def ok(self, method: str, path: str, **kw) -> bool:
        import httpx

        try:
            return self.request(method, path, **kw).status_code == 200
        except httpx.HTTPError:
            return False


def create_pool(api: ApiClient) -> None:
    """Pool `openrouter` as docker/init.sh's `airflow pools set` makes it, over REST: the api-server
    is up anyway, and a CLI process would import Airflow again for one row."""
    import httpx

    try:
        r = api.request(
            "POST",
            "/pools",
            json={
                "name": OPENROUTER_POOL,
                "slots": OPENROUTER_POOL_SLOTS,
                "description": "OpenRouter overflow generation (eagle3-datagen)",
            },
        )
    except httpx.HTTPError as exc:
        raise UserError(f"creating pool {OPENROUTER_POOL}: {exc}") from None
    if r.status_code not in (200, 201):
        raise UserError(f"creating pool {OPENROUTER_POOL} failed: {r.status_code} {r.text[:500]}")


def worker_env(env: dict[str, str], queue: str) -> dict[str, str]:
    """A worker's env: its hostname, and Airflow's Celery config plus a warm-up of what the tasks
    load (celery_config.py: the tasks, forked from the worker, start with it)."""
    return {
        **env,
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "eagle3_devtools.cluster.worker_hostname",
        "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "eagle3_devtools.celery_config.CELERY_CONFIG",
        WORKER_HOSTNAME_ENV: f"{queue}-worker",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "include"), env.get("PYTHONPATH", "")) if p),
    }


def worker_argv(queue: str, concurrency: int) -> list[str]:
    return airflow_cmd(
        "celery",
        "worker",
        "--queues",
        queue,
        "--concurrency",
        str(concurrency),
        "--celery-hostname",
        f"{queue}@%h",
        "--skip-serve-logs",
        "--without-mingle",
        "--without-gossip",
    )


def airflow_services(api_port: int, concurrency: dict[str, int]) -> dict[str, list[str]]:
    """The Airflow processes, as docker-compose.yaml's services run them (test_cluster_compose.py
    checks that the two lists agree)."""
    return {
        "api-server": airflow_cmd("api-server", "-H", "127.0.0.1", "-p", str(api_port), "-w", "1"),
        "scheduler": airflow_cmd("scheduler", "--skip-serve-logs"),
        "dag-processor": airflow_cmd("dag-processor"),
        "triggerer": airflow_cmd("triggerer", "--skip-serve-logs"),
        **{f"worker-{q}": worker_argv(q, concurrency[q]) for q in QUEUES},
    }


DEFAULT_CONCURRENCY = {
    DEFAULT_QUEUE: 2,
    GPU_QUEUE: 1,
}  # compose: CPU_WORKER_CONCURRENCY 8, GPU 1 (a laptop has fewer cores)


def _worker_ready(log: Path) -> bool:
    try:
        return " ready." in log.read_text(errors="replace")
    except FileNotFoundError:
        return False


@contextmanager
def cluster(
    workdir: str | os.PathLike,
    *,
    api_port: int | None = None,
    config_overrides: dict | None = None,
    worker_concurrency: dict[str, int] | None = None,
    upload_today: bool = True,
    airflow_overrides: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """Start the whole cluster, yield it, stop everything on exit (any exit). `airflow_overrides`:
    extra `AIRFLOW__*` settings for every process and the env file (the test tier's timings)."""
    check_system_tools()
    work = Path(workdir).resolve()
    state = work / "services.json"
    left = reap_leftovers(state)
    if left:
        print(f"cluster: stopped leftovers of a previous start: {', '.join(left)}", file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    concurrency = {**DEFAULT_CONCURRENCY, **(worker_concurrency or {})}
    api_port = api_port or free_port()
    overrides = CLUSTER_OVERRIDES if config_overrides is None else config_overrides

    with ExitStack() as stack:
        # Postgres' data dir lives in /tmp (a work dir under a 0700 parent is out of the postgres
        # user's reach); removed after every service has stopped (callbacks run last-in first-out).
        pg_base = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
        stack.callback(shutil.rmtree, pg_base, True)
        svc = stack.enter_context(Services(work / "logs", state))
        pg_password, ui_password = secrets.token_urlsafe(16), secrets.token_urlsafe(12)
        pg_port = start_postgres(svc, pg_password, pg_base)
        redis_port = start_redis(svc, work)
        # The migration needs only the database: it runs while SeaweedFS and the dev server start.
        migrate = svc.start(
            "db-migrate",
            airflow_cmd("db", "migrate"),
            {**os.environ, **database_env(work, pg_port=pg_port, pg_password=pg_password)},
        )
        dev = stack.enter_context(dev_stack(work, config_overrides=overrides))
        passwords = work / "passwords.json"
        passwords.write_text(json.dumps({ADMIN_USER: ui_password}))
        passwords.chmod(0o600)
        env = {
            **os.environ,
            **cluster_env(
                work,
                dev,
                api_port=api_port,
                pg_port=pg_port,
                pg_password=pg_password,
                redis_port=redis_port,
                passwords_file=passwords,
            ),
            **(airflow_overrides or {}),
        }
        if upload_today:
            upload_prompts(dev.client(), load_config(dev.config_path), f"{datetime.now(timezone.utc):%Y-%m-%d}")
        finish_job(svc, migrate)

        for name, argv in airflow_services(api_port, concurrency).items():
            queue = name.removeprefix("worker-")
            svc.start(name, argv, worker_env(env, queue) if queue in QUEUES else env)
        base = f"http://127.0.0.1:{api_port}"
        _wait(lambda: http_ok(f"{base}/api/v2/monitor/health"), "the api-server's health", svc, 240)
        # The Execution API (tasks report to it) builds its versioned routes on its first request:
        # about 5 s of CPU, which the first task would otherwise wait for, retrying on timeouts.
        _wait(lambda: http_ok(f"{base}/execution/health"), "the api-server's Execution API", svc, 240)
        for queue in QUEUES:
            log_path = svc.services[f"worker-{queue}"].log_path
            _wait(functools.partial(_worker_ready, log_path), f"celery worker {queue}", svc, 240)
        api = ApiClient(base, ADMIN_USER, ui_password)
        create_pool(api)
        # Up once the DAG is parsed: a person can unpause and trigger it.
        _wait(lambda: api.ok("GET", f"/dags/{DAG_ID}"), f"DAG {DAG_ID} parsed by the dag-processor", svc, 240)
        env_file = write_env_file(work / "cluster.env", env, env_file_keys(env))
        yield Cluster(work, base, ADMIN_USER, ui_password, env, env_file, dev, svc)


def supervise(c: Cluster) -> int:
    """Block until a core service dies (exit 1); restart a dead Celery worker (restart: always)."""
    svc = c.services
    while True:
        for name in svc.dead():
            if name.startswith("worker-"):
                print(
                    f"cluster: {name} exited with {svc.services[name].proc.returncode}: starting it again",
                    file=sys.stderr,
                    flush=True,
                )
                svc.restart(name)
                (c.workdir / "restarts.json").write_text(json.dumps(svc.pids()))
            else:
                print(
                    f"cluster: {name} exited (log {svc.services[name].log_path}): stopping everything",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        time.sleep(0.5)


def banner(c: Cluster) -> str:
    return (
        f"\nAirflow UI:  {c.api_url}   user {c.username}  password {c.password}\n"
        f"DAG {DAG_ID} is paused: unpause it, then Trigger (the form shows the params).\n"
        f"Executor CeleryExecutor: workers for queues {', '.join(QUEUES)}; Postgres + Redis on loopback.\n"
        f"S3 (SeaweedFS): {c.stack.s3_endpoint}  access key {c.stack.s3.access_key}  secret key "
        f"{c.stack.s3.secret_key}\n"
        f"Dev inference server: {c.stack.inference_url}\n"
        f"Env for the CLI, boto3 and airflow:  source {c.env_file}\n"
        f"Logs: {c.workdir / 'logs'}.  Ctrl-C (or SIGTERM/SIGHUP) stops everything."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=REPO / "demo-output" / "cluster", help="recreated on each start"
    )
    parser.add_argument("--port", type=int, default=None, help="api-server port (default: a free one)")
    parser.add_argument(
        "--ready-file", type=Path, default=None, help="write the env file's path here once everything is up"
    )
    parser.add_argument(
        "--config-overrides",
        type=json.loads,
        default=None,
        help=f"pipeline config overrides as JSON (default: {json.dumps(CLUSTER_OVERRIDES)})",
    )
    parser.add_argument(
        "--airflow-env",
        type=json.loads,
        default=None,
        help='extra Airflow settings as JSON, e.g. {"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600"}',
    )
    args = parser.parse_args(argv)
    if args.airflow_env is not None and not (
        isinstance(args.airflow_env, dict)
        and all(
            isinstance(k, str) and k.startswith("AIRFLOW__") and isinstance(v, str) for k, v in args.airflow_env.items()
        )
    ):
        parser.error("--airflow-env: a JSON object of AIRFLOW__SECTION__KEY names to string values")

    def serve() -> int:
        with cluster(
            args.workdir, api_port=args.port, config_overrides=args.config_overrides, airflow_overrides=args.airflow_env
        ) as c:
            print(banner(c), flush=True)
            if args.ready_file:
                args.ready_file.write_text(str(c.env_file))
            return supervise(c)

    return run_launcher("cluster", serve)


if __name__ == "__main__":
    sys.exit(main())
