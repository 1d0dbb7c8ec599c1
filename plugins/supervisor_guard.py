"""A task process whose Airflow supervisor dies dies with it, as on a lost node.

Since Airflow 3.2 (apache/airflow#65738) the supervisor forks the task runner into a process group
of its own, so that its signals reach the task's children. The price: a worker that dies without
taking the runner along (`kill -9` of the worker's process group, the OOM killer choosing the
supervisor or the Celery worker) leaves the runner going on as an orphan. The scheduler, seeing no
heartbeat, retries the task on another worker, while the orphan still holds the stage's lease:
each retry is refused (StageBusy) until the orphan's stage ends, which for a generation stage of
hours outlasts every retry and fails the dataset (seen in a `make test`
cluster run, 2026-12-05).

So every stage call runs with the kernel's parent-death signal set (Linux `PR_SET_PDEATHSIG`) to
SIGKILL: the runner ends with its supervisor, which is what the pipeline is built to survive (a
retry takes over a dead holder's lease and resumes from the committed parts; at most one
unfinished part is redone, and paid answers are in the journal). Not an exception raised in the
stage, as an execution timeout raises `AirflowTaskTimeout`: raised wherever the stage happened to
be, it hung the stage's cleanup in one `make test` run, and the orphan renewed its lease for
minutes while every retry was refused.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGKILL


@contextmanager
def stop_with_supervisor() -> Iterator[None]:
    """Within the block, the death of this process's parent kills this process.

    Outside Linux a no-op. Under `dag.test()` the parent is the test's: its death ends the test's
    process, as it should."""
    if not sys.platform.startswith("linux"):
        yield
        return
    supervisor = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
    if os.getppid() != supervisor:  # it died between reading it and setting the signal
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
    try:
        yield
    finally:
        libc.prctl(PR_SET_PDEATHSIG, 0)
