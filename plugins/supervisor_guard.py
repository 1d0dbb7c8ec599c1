"""A task process whose Airflow supervisor dies stops its stage at once.

Since Airflow 3.2 (apache/airflow#65738) the supervisor forks the task runner into a process group
of its own, so that its signals reach the task's children. The price: a worker that dies without
taking the runner along (`kill -9` of the worker's process group, the OOM killer choosing the
supervisor or the Celery worker) leaves the runner going on as an orphan. The scheduler, seeing no
heartbeat, retries the task on another worker, while the orphan still holds the stage's lease and
keeps generating: each retry is refused (StageBusy) until the orphan's stage ends, which for a
generation stage of hours outlasts every retry and fails the dataset (benchmarks/RESULTS.md, "A
killed worker's task runner").

So every stage call runs with the kernel's parent-death signal set (Linux `PR_SET_PDEATHSIG`):
when the supervisor dies the runner gets SIGUSR1 at once, and the handler raises `SupervisorGone`
in the stage, as an execution_timeout raises `AirflowTaskTimeout`: the stage's writer checkpoints
what it holds and releases its lease, and the retry resumes from there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGUSR1  # unused by Airflow's task runner (it handles TERM and ALRM)


class SupervisorGone(BaseException):
    """The process that started this task is gone. A BaseException, as AirflowTaskTimeout is: a
    stage's `except Exception` (an endpoint's retry loop) must not swallow it."""


@contextmanager
def stop_with_supervisor() -> Iterator[None]:
    """Within the block, the death of this process's parent raises `SupervisorGone` in it.

    Outside Linux, or off the main thread (where no signal handler can be set), a no-op. Under
    `dag.test()` the parent is the test's: its death ends the stage, as it should."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        yield
        return
    supervisor = os.getppid()

    def on_parent_death(signum, frame) -> None:
        raise SupervisorGone(
            f"this task's supervisor (pid {supervisor}) died: the scheduler retries the task; "
            f"stopping here so that the retry takes the stage"
        )

    previous = signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    try:
        if os.getppid() != supervisor:  # died between reading it and setting the signal
            on_parent_death(PARENT_DEATH_SIGNAL, None)
        yield
    finally:
        libc.prctl(PR_SET_PDEATHSIG, 0)
        signal.signal(PARENT_DEATH_SIGNAL, previous)
