"""plugins/supervisor_guard.py: a task process whose supervisor dies stops its stage.

The process layout is Airflow's since 3.2: a supervisor forks the task runner into a process
group of its own; the supervisor's group is SIGKILLed (a killed worker) and the runner, which
that signal does not reach, must stop by itself. The cluster tier's killed run
(tests/cluster/conftest.py `killed_run`) is the same with Airflow's own processes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))

from supervisor_guard import PARENT_DEATH_SIGNAL, stop_with_supervisor  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PR_GET_PDEATHSIG = 2
# The runner: a stage that would go on for two minutes (bounded, so that without the guard it does
# not outlive the test by long); what ends it is written to `out`.
RUNNER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {plugins!r})
    from supervisor_guard import stop_with_supervisor, SupervisorGone
    out = {out!r}
    try:
        with stop_with_supervisor():
            open(out, "w").write("working")
            end = time.monotonic() + 120
            while time.monotonic() < end:
                time.sleep(0.05)
    except SupervisorGone as exc:
        open(out, "w").write("stopped: " + str(exc))
    """
)
# The supervisor: starts the runner in a process group of its own (as Airflow's does) and waits.
SUPERVISOR = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]], process_group=0).wait()"


def parent_death_signal() -> int:
    value = ctypes.c_int()
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value)) == 0
    return value.value


def test_a_runner_whose_supervisor_is_killed_stops_its_stage(tmp_path):
    out = tmp_path / "runner.txt"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, RUNNER.format(plugins=str(REPO / "plugins"), out=str(out))],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or out.read_text() != "working":
            assert supervisor.poll() is None and time.monotonic() < deadline, "the runner did not start"
            time.sleep(0.05)
        os.killpg(supervisor.pid, signal.SIGKILL)  # the worker's group: the runner is not in it
        supervisor.wait()
        deadline = time.monotonic() + 60
        while out.read_text() == "working" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text() == (
            f"stopped: this task's supervisor (pid {supervisor.pid}) died: the scheduler retries the task; "
            f"stopping here so that the retry takes the stage"
        )
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)


def test_the_guard_is_undone_after_the_stage():
    previous = signal.getsignal(PARENT_DEATH_SIGNAL)
    with stop_with_supervisor():
        assert parent_death_signal() == PARENT_DEATH_SIGNAL
        assert signal.getsignal(PARENT_DEATH_SIGNAL) is not previous
    assert parent_death_signal() == 0
    assert signal.getsignal(PARENT_DEATH_SIGNAL) is previous
