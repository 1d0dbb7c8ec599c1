"""Child processes of the dev stack: a free loopback port, and waiting until one answers HTTP.

One place for the start-up wait, so the dev inference server, `make demo`, `make airflow` and
the tests all fail the same way: at once when the child dies, with its log's path.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from eagle3_data.errors import UserError


def free_port() -> int:
    """A port free on 127.0.0.1 now (services started here bind loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http_ok(
    url: str, procs: list[subprocess.Popen], what: str, log: Path | str | None, timeout_s: float = 120.0
) -> None:
    """Return once GET `url` answers 200; raise UserError if a process in `procs` exits first
    or the deadline passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise UserError(f"{what} exited with code {dead[0].returncode} during start-up (log: {log})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise UserError(f"{what} did not answer {url} within {timeout_s:.0f} s (log: {log})")
