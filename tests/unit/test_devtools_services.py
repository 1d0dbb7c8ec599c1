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
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
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
