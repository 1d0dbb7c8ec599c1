"""A test that times out is reported, not waited on: its stacks (its own, and py-spy's of each
process it started) and the logs of its services land in test-artifacts/hangs/ and are printed,
and the session goes on to the next test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

INNER = """
import subprocess, sys, time
import pytest
from tests.hang_report import watch_logs

CHILD = "import time\\ndef stuck_in_the_child():\\n    time.sleep(600)\\nstuck_in_the_child()\\n"

@pytest.mark.timeout(3)
def test_waits_on_a_stuck_child(tmp_path):
    (tmp_path / "service.log").write_text("the service's last words\\n")
    watch_logs(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    try:
        child.wait()  # never returns on its own
    finally:
        child.kill()

def test_the_session_goes_on():
    assert True
"""


def test_timed_out_test_leaves_stacks_and_logs(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {
        **os.environ,
        "EAGLE3_TEST_ARTIFACTS": str(tmp_path / "artifacts"),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "include")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.hang_report",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 passed" in out, out  # the hung test failed; the next one still ran
    assert "Timeout (>3 s)" in out and "HANG REPORT" in out
    assert "stuck_in_the_child" in out  # py-spy's stack of the child, printed
    [report] = (tmp_path / "artifacts" / "hangs").iterdir()
    stacks = {p.name: p.read_text() for p in report.glob("stacks-*.txt")}
    assert any("stuck_in_the_child" in text for text in stacks.values()), stacks
    assert any("test_waits_on_a_stuck_child" in text for name, text in stacks.items() if "pytest" in name)
    logs = list((report / "logs").rglob("service.log"))
    assert logs and logs[0].read_text() == "the service's last words\n"
