"""The suite's warm speculators interpreter (tests/speculators_fork.py) against the venv's own: the
same script, arguments, working directory, environment and input give the same output, error
output and exit status; a caller's timeout stops the script and what it started."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from eagle3_data.stages.probe.drafter import PYTHON_ENV
from eagle3_data.storage.lease import has_exited
from tests.fixtures.speculators import SERVER_PYTHON, SHIM_FOLDER

SCRIPT = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORK_TEST"),
                  "path0": sys.path[0], "stdin": sys.stdin.read(), "name": __name__}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "message":
    sys.exit("stopped: " + sys.argv[2])
if sys.argv[1] == "raise":
    raise ValueError("from the script")
"""


@pytest.fixture
def warm() -> str:
    if SHIM_FOLDER is None:
        pytest.skip(f"${PYTHON_ENV} is the user's own: the suite runs no warm interpreter")
    assert os.environ[PYTHON_ENV] == str(SHIM_FOLDER / "python")
    started = subprocess.run([os.environ[PYTHON_ENV], "-c", "pass"], capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr  # the server is up (its start is not timed below)
    return os.environ[PYTHON_ENV]


@pytest.mark.parametrize(
    "argv", [["ok", "a b"], ["exit", "3"], ["message", "why"], ["raise"], ["-c", "import sys; print(sys.argv)", "x"]]
)
def test_warm_runs_a_script_as_the_venvs_python_does(warm, tmp_path, argv):
    script = tmp_path / "folder" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    args = argv if argv[0] == "-c" else [str(script), *argv]
    runs = [
        subprocess.run(
            [python, *args],
            cwd=tmp_path,
            env={**os.environ, "FORK_TEST": "value"},
            input="from stdin",
            capture_output=True,
            text=True,
            timeout=120,
        )
        for python in (str(SERVER_PYTHON), warm)
    ]
    cold, got = ([r.returncode, r.stdout, r.stderr] for r in runs)
    assert got == cold
    assert cold[0] == {"ok": 0, "exit": 3, "message": 1, "raise": 1, "-c": 0}[argv[0]]


def test_a_callers_timeout_stops_the_script_and_its_children(warm, tmp_path):
    pids = tmp_path / "pids"
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\n"
        "time.sleep(300)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([warm, "-c", code, str(pids)], capture_output=True, timeout=5)
    assert pids.exists(), "the script never ran"
    deadline = time.monotonic() + 10
    alive = [int(p) for p in pids.read_text().split()]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not has_exited(p)]
        time.sleep(0.1)
    assert not alive, f"still running after the caller's timeout: {alive}"


def test_the_socket_path_fits_a_unix_socket_under_a_long_tmpdir(tmp_path, monkeypatch):
    """A Unix socket's path holds at most 107 bytes (bind fails past it); a CI runner's $TMPDIR can
    be long, and every speculators script of the suite would then fail to start."""
    import shutil
    import tempfile

    from tests.fixtures import speculators

    long_tmp = tmp_path / ("x" * 90)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    folder = speculators._install_shim()
    try:
        assert folder is not None and len(os.fsencode(folder / "socket.new")) <= 107, folder
        assert os.environ[PYTHON_ENV] == str(folder / "python")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
