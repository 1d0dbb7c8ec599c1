"""Last in the tier (file order): SIGTERM to `make cluster`'s launcher stops every service it
started, process groups included, and frees every port, so a second start finds nothing left
over. (SIGHUP and Ctrl-C take the same path: tests/unit/test_devtools_services.py.)"""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from urllib.parse import urlsplit

from eagle3_devtools.services import group_members


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and text in cmd:
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


def test_sigterm_stops_everything(cluster):
    env = cluster.env
    ports = {
        name: urlsplit(env[key].replace("db+", "").replace("postgresql+psycopg2", "postgresql")).port
        for name, key in [
            ("api-server", "AIRFLOW__API__BASE_URL"),
            ("postgres", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"),
            ("redis", "AIRFLOW__CELERY__BROKER_URL"),
            ("s3", "AWS_ENDPOINT_URL"),
            ("dev server", "EAGLE3_DEV_SERVER_URL"),
        ]
    }
    assert [n for n, p in ports.items() if not _port_open(p)] == [], ports  # all serving before the stop
    ports["scheduler health"] = int(env["AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT"])  # free after it
    services = cluster.services()
    assert set(services) >= {
        "postgres",
        "redis",
        "api-server",
        "scheduler",
        "dag-processor",
        "triggerer",
        "worker-default",
        "worker-gpu",
    }

    cluster.launcher.send_signal(signal.SIGTERM)
    assert cluster.launcher.wait(180) == 0
    assert {n: group_members(s["pgid"]) for n, s in services.items() if group_members(s["pgid"])} == {}
    assert _processes_mentioning(str(cluster.workdir)) == []
    assert [n for n, p in ports.items() if _port_open(p)] == []
    assert not (cluster.workdir / "services.json").exists()
