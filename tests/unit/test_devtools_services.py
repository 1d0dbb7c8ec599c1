"""The launchers' process handling (include/eagle3_devtools/services.py), on stand-in services:
SIGTERM, SIGHUP and Ctrl-C each stop every child's whole process group (a grandchild that the
service forked included), and a start after a SIGKILLed launcher removes its leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_devtools.services import group_members, reap_leftovers

REPO = Path(__file__).resolve().parents[2]
# A launcher like make cluster's: two services, each a shell that forks a grandchild and ignores
# nothing; prints READY once both run.
LAUNCHER = """
import sys, time
from pathlib import Path
from eagle3_devtools.services import Services, Stop, stop_on_signals
work = Path(sys.argv[1])
with stop_on_signals():
    try:
        with Services(work / "logs", work / "services.json") as svc:
            for name in ("db", "worker"):
                svc.start(name, ["sh", "-c", "sleep 300 & sleep 300; wait"], {"PATH": "/usr/bin:/bin"}, grace=2)
            print("READY", flush=True)
            while True:
                time.sleep(0.1)
    except (KeyboardInterrupt, Stop) as exc:
        print("STOPPED", type(exc).__name__, flush=True)
"""


def _launch(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "include")}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "READY"
    state = json.loads((tmp_path / "services.json").read_text())
    deadline = time.monotonic() + 30
    while any(len(group_members(s["pgid"])) < 3 for s in state.values()):  # sh + two sleeps each
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, state


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_stops_every_process_group(tmp_path, sig):
    proc, state = _launch(tmp_path)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.startswith("STOPPED")
    assert {n: group_members(s["pgid"]) for n, s in state.items()} == {"db": [], "worker": []}
    assert not (tmp_path / "services.json").exists()


def test_next_start_removes_what_a_sigkilled_launcher_left(tmp_path):
    proc, state = _launch(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup possible
    proc.wait()
    assert all(group_members(s["pgid"]) for s in state.values())
    assert sorted(reap_leftovers(tmp_path / "services.json")) == ["db", "worker"]
    assert {n: group_members(s["pgid"]) for n, s in state.items()} == {"db": [], "worker": []}


# Each records, when it gets SIGTERM (which it ignores, so only the SIGKILL after the grace ends
# it), whether the services named in $PEERS are still running.
_STUBBORN = """trap 'for p in $PEERS; do
  kill -0 "$(cat "$DIR/$p.pid")" 2>/dev/null && echo "$p alive" || echo "$p gone"; done > "$DIR/$NAME.term"' TERM
echo $$ > "$DIR/$NAME.pid"; while :; do sleep 0.05; done"""


def test_stop_all_signals_the_services_together_and_the_infrastructure_last(tmp_path):
    """The services' grace periods run side by side (each one in turn would add them up), and
    a database or broker is stopped only after everything that may still use it."""
    from eagle3_devtools.services import Services

    def start(svc, name, peers, infrastructure=False):
        env = {"PATH": "/usr/bin:/bin", "DIR": str(tmp_path), "NAME": name, "PEERS": " ".join(peers)}
        svc.start(name, ["sh", "-c", _STUBBORN], env, grace=2, infrastructure=infrastructure)

    with Services(tmp_path / "logs", tmp_path / "services.json") as svc:
        start(svc, "db", ["api", "worker"], infrastructure=True)
        start(svc, "api", ["worker", "db"])
        start(svc, "worker", ["api", "db"])
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"{n}.pid").exists() for n in ("db", "api", "worker")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    term = {n: (tmp_path / f"{n}.term").read_text().split("\n")[:-1] for n in ("db", "api", "worker")}
    assert term == {
        "api": ["worker alive", "db alive"],
        "worker": ["api alive", "db alive"],
        "db": ["api gone", "worker gone"],
    }


def test_sigterm_to_make_reaches_the_launcher(tmp_path):
    """`kill <make's pid>`: make passes SIGTERM to its recipe's process only, so the launcher must
    be that process (the Makefile `exec`s it), not a child of a shell that dies alone."""
    out = tmp_path / "launcher"
    stub = tmp_path / "python"  # stands in for the venv's python: records its pid and the signal
    stub.write_text(
        f"#!/bin/sh\ntrap 'echo TERM > {out}.signal; exit 0' TERM\necho $$ > {out}.pid\nwhile :; do sleep 0.05; done\n"
    )
    stub.chmod(0o755)
    make = subprocess.Popen(
        ["make", "-s", "-C", str(REPO), "airflow", f"PY={stub}", f"STAMP={stub}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pid_file = tmp_path / "launcher.pid"
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and make.poll() is None
            time.sleep(0.05)
        make.send_signal(signal.SIGTERM)
        make.wait(30)
        deadline = time.monotonic() + 10
        while not (tmp_path / "launcher.signal").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "launcher.signal").read_text().strip() == "TERM"
    finally:
        os.killpg(make.pid, signal.SIGKILL) if group_members(make.pid) else None


def test_a_service_that_dies_during_start_up_is_named_with_the_end_of_its_log(tmp_path):
    """A CI run's cluster failed with only 'an Airflow process exited with code 3': the wait
    now names the service and quotes why it died."""
    from eagle3_data.errors import UserError
    from eagle3_devtools.cluster import _wait
    from eagle3_devtools.services import Services

    with Services(tmp_path / "logs", tmp_path / "services.json") as svc:
        svc.start("scheduler", ["sleep", "300"], {"PATH": "/usr/bin:/bin"}, grace=2)
        svc.start(
            "api-server",
            ["sh", "-c", "echo starting; echo '[Errno 98] address already in use' >&2; exit 3"],
            {"PATH": "/usr/bin:/bin"},
        )
        with pytest.raises(UserError) as err:
            _wait(lambda: False, "the api-server's health", svc, 30)
    message = str(err.value)
    assert message.startswith("api-server exited with code 3 while waiting for the api-server's health")
    assert "[Errno 98] address already in use" in message
    assert "scheduler" not in message
