"""The benchmark smoke's processes run in the background from the start of the session, two at a
time, instead of one after the other when their tests come up.

In `make test` this tier shares its pytest process with the dags tier and the machine with two
other pytest processes (Makefile). Every smoke runs at `nice -n 19`, so it takes the CPU the
others leave: started with the session they fill the cores' idle moments while the dags tests
and the other tiers run (the cluster's waits on Airflow's scheduling), and at the end, when the
other tiers are done, two of them keep both cores busy where one left a core idle for the
last minute (`make test`'s row in benchmarks/RESULTS.md). Longest first,
so that the last to finish are short. A test waits for its own benchmark's outcome.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import run_all  # noqa: E402

AT_ONCE = 2  # the CI machine's cores; each smoke has one compute thread (run_all.SMOKE_ENV)
# A smoke takes seconds to a minute and a half of CPU, but niced it waits for the other tiers' CPU:
# bounded by the whole suite's length rather than its own (its test still has pytest's timeout).
BOUND_S = 2400  # make test's tiers saturate both cores for ~28 min (its row in RESULTS.md): a niced smoke waits
# By the CPU each took in make test (2026-12-05, benchmarks/RESULTS.md); the rest keep run_all's order.
LONGEST_FIRST = ("vllm_extract", "probe_faults", "gpu_extract", "probe_resplit", "scale", "gpu_probe")

_runs: dict[str, Future] = {}
_live: set[subprocess.Popen] = set()
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_stopping = False


def run_smoke(name: str) -> tuple[list[str], subprocess.CompletedProcess]:
    """(command, its completed process) of benchmark `name` at its smoke size, niced; raises
    FileNotFoundError when its requirement is missing (run_all.command)."""
    cmd = run_all.command(name, "smoke")
    with _lock:
        if _stopping:
            raise RuntimeError("the session is ending")
        proc = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, *cmd],
            cwd=REPO,
            env=run_all.env("smoke"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # its own process group, to be stopped with the servers and engines it starts; not a
            # session of its own: with the kernel's autogroup scheduling (Debian's default) a new
            # session is a scheduling group of its own, which the other tiers' processes share the
            # CPU with as equals, whatever its nice value (it ended the other tiers 2 min later)
            process_group=0,
        )
        _live.add(proc)
    try:
        try:
            out, _ = proc.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = (proc.communicate()[0] or "") + f"\n[stopped: still running after {BOUND_S} s]"
    finally:
        with _lock:
            _live.discard(proc)
    return cmd, subprocess.CompletedProcess(proc.args, proc.returncode, out)


@pytest.fixture
def smoke_outcome():
    """name -> (command, completed process) of its background run (pytest_collection_finish
    started one for every collected smoke test), waiting for it."""
    return lambda name: _runs[name].result()


def pytest_collection_finish(session: pytest.Session) -> None:
    global _pool
    names = [
        item.callspec.params["name"]
        for item in session.items
        if getattr(item, "originalname", None) == "test_benchmark_smoke"
    ]
    if session.config.option.collectonly or not names:
        return
    order = [n for n in LONGEST_FIRST if n in names] + [n for n in names if n not in LONGEST_FIRST]
    _pool = ThreadPoolExecutor(AT_ONCE, thread_name_prefix="benchmark-smoke")
    for name in order:
        _runs[name] = _pool.submit(run_smoke, name)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A session that ends early (-x, a failure elsewhere, ^C) stops the smokes still running."""
    global _stopping
    if _pool is None:
        return
    with _lock:
        _stopping = True
        for proc in _live:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _pool.shutdown(wait=True, cancel_futures=True)
