"""plugins/supervisor_guard.py: a task process whose supervisor dies dies with it.

The process layout is Airflow's since 3.2: a supervisor forks the task runner into a process
group of its own; the supervisor's group is SIGKILLed (a killed worker) and the runner, which
that signal does not reach, must end too. The cluster tier's killed run
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

from eagle3_data.storage.lease import has_exited  # noqa: E402  (a zombie counts: PID 1 may not reap orphans)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PR_GET_PDEATHSIG = 2
# The runner: a stage that would go on for two minutes (bounded, so that without the guard it does
# not outlive the test by long); it writes its pid once working.
RUNNER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {plugins!r})
    from supervisor_guard import stop_with_supervisor
    with stop_with_supervisor():
        open({out!r}, "w").write(str(os.getpid()))
        end = time.monotonic() + 120
        while time.monotonic() < end:
            time.sleep(0.05)
    """
)
# The supervisor: starts the runner in a process group of its own (as Airflow's does) and waits.
SUPERVISOR = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]], process_group=0).wait()"


def parent_death_signal() -> int:
    value = ctypes.c_int()
    assert ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value)) == 0
    return value.value


def test_a_runner_whose_supervisor_is_killed_dies_with_it(tmp_path):
    out = tmp_path / "runner.pid"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, RUNNER.format(plugins=str(REPO / "plugins"), out=str(out))],
        start_new_session=True,
    )
    runner = None
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or not out.read_text():
            assert supervisor.poll() is None and time.monotonic() < deadline, "the runner did not start"
            time.sleep(0.05)
        runner = int(out.read_text())
        assert not has_exited(runner)
        os.killpg(supervisor.pid, signal.SIGKILL)  # the worker's group: the runner is not in it
        supervisor.wait()
        deadline = time.monotonic() + 30
        while not has_exited(runner) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert has_exited(runner), f"the runner {runner} outlived its supervisor"
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        if runner is not None and not has_exited(runner):
            os.kill(runner, signal.SIGKILL)


def test_the_guard_is_undone_after_the_stage():
    with stop_with_supervisor():
        assert parent_death_signal() == PARENT_DEATH_SIGNAL
    assert parent_death_signal() == 0
