"""Child processes of the dev stack: a free loopback port, and waiting until one answers HTTP.

One place for the start-up wait, so the dev inference server, `make demo`, `make airflow` and
the tests all fail the same way: at once when the child dies, with its log's path and last lines.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_data.errors import UserError
from eagle3_data.forksafe import PerProcess

if TYPE_CHECKING:
    import httpx

PORT_FLOOR = 10000  # ports we hand out lie in [PORT_FLOOR, the kernel's ephemeral range)
_handed_out: set[int] = set()  # never the same port twice from one process


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (bind(0) and connect() take ports from it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range.

    The services we start bind their port seconds to minutes after this returns (the api-server
    first imports Airflow; `make cluster` migrates the database in between). A port from bind(0)
    lies in the ephemeral range, which the kernel also hands to every outgoing connection
    meanwhile (boto3, httpx, the Postgres clients): one that holds it makes the service's bind fail
    (uvicorn exits 3, as the api-server did in a CI run). Below the range only another explicit
    bind can take it; SGLang's `get_free_port_below_ephemeral` chooses its ports the same way.
    """
    below = range(PORT_FLOOR, ephemeral_low())
    for port in random.sample(below, 64) if len(below) > 1000 else ():
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a kernel whose ephemeral range starts low: what it hands out
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def log_tail(path: Path | str | None, lines: int = 20) -> str:
    """The last lines of a child's log, for an error that says why it died ('' when none)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) if path else ""
    except OSError:  # a folder, or not written yet
        return ""


def _http_client():
    import httpx

    return httpx.Client()


_LOCAL_HTTP = PerProcess(_http_client)


def local_http() -> httpx.Client:
    """This process's httpx client for the dev tools' loopback HTTP: the start-up poll, the dev
    server's control endpoints, the cluster's REST API. `httpx.get` builds a client per call, and
    every client an SSL context that loads the CA bundle (~20 ms of CPU, for plain http too): the
    start-up poll paid it every 0.2 s while a server started (`make test`'s row in
    benchmarks/RESULTS.md). Made again in a forked child, whose parent's client
    is not its own (`forksafe.PerProcess`)."""
    return _LOCAL_HTTP.get()


def http_ok(url: str) -> bool:
    """GET `url` answers 200 now."""
    import httpx

    try:
        return local_http().get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http_ok(
    url: str, procs: list[subprocess.Popen[Any]], what: str, log: Path | str | None, timeout_s: float = 120.0
) -> None:
    """Return once GET `url` answers 200; raise UserError if a process in `procs` exits first
    or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            tail = log_tail(log)
            raise UserError(
                f"{what} exited with code {dead[0].returncode} during start-up (log: {log})"
                + (f"; its log ends:\n{tail}" if tail else "")
            )
        if http_ok(url):
            return
        time.sleep(0.2)
    raise UserError(f"{what} did not answer {url} within {timeout_s:.0f} s (log: {log})")
