"""What the demo prints while it waits, and what it prints instead of Airflow's log of a failure
it causes on purpose.

Piped (`make demo | cat`, CI), the demo once printed nothing for minutes: the dev builds, the
services' start and `dag.test()` (Airflow's per-task lines are silenced) write nothing to stdout.
`Heartbeat` names the phase every few seconds when stdout is not a terminal.

The second demo run fails its gate on purpose; Airflow logs that failure as it would any other
(a traceback per failed task, "No tasks to run" while it waits on them). `captured_output` keeps
that log in a file, and `expected_failure` says in one paragraph what happened, or returns None
when the run failed otherwise than meant, so the caller shows the log itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

HEARTBEAT_S = 8.0  # under the 10 s a person (or a CI step's idle timeout) reads as "hung"


class Heartbeat:
    """A line `demo: still <phase> (<n> s)` every `every_s` while a phase is set, on a stream that
    is not a terminal (a terminal shows the services' progress bars and is read live anyway).
    Its stream is its own (`for_stdout`): output captured from fds 1 and 2 does not swallow it."""

    def __init__(self, stream: TextIO, every_s: float = HEARTBEAT_S):
        self.stream, self.every_s = stream, every_s
        self.phase: str | None = None
        self.since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_stdout(cls) -> Heartbeat:
        """On a duplicate of fd 1, line-buffered: still the terminal or pipe while fd 1 is captured."""
        sys.stdout.flush()
        return cls(open(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8"))

    @property
    def beats(self) -> bool:
        return not self.stream.isatty()

    def enter(self, phase: str | None) -> None:
        """The phase now under way (None: between phases, nothing to say)."""
        self.phase, self.since = phase, time.monotonic()

    def line(self, now: float) -> str | None:
        return None if self.phase is None else f"demo: still {self.phase} ({now - self.since:.0f} s)"

    def __enter__(self) -> Heartbeat:
        if self.beats:
            self._thread = threading.Thread(target=self._run, name="demo-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.stream.close()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            line = self.line(time.monotonic())
            if line is not None:
                self.stream.write(line + "\n")


@contextmanager
def captured_output(path: Path) -> Iterator[Path]:
    """Everything written to fds 1 and 2 inside the block (Airflow's structlog lines, tracebacks,
    warnings, child processes' output) goes to `path` instead of the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "wb") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            try:
                yield path
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


# The gate run's tasks that fail when its one dataset's gate fails: validate raises, merge and
# publish refuse a run with a failed gate (every other task succeeds, or is upstream_failed).
EXPECTED_FAILED = frozenset({"dataset.validate", "merge", "publish"})


def expected_failure(
    dataset: str, states: Sequence[tuple[str, str, str, float]], gates: dict[str, dict], log: Path, log_text: str
) -> str | None:
    """One paragraph for a run that failed as meant: only `dataset`'s gate failed (its reasons,
    from its validate manifest), and no task failed but those that fail for it. None otherwise:
    the caller shows the run's log, tracebacks included. `states`: (task id, map name, state,
    seconds) per task instance; `gates`: each dataset's gate as its validate manifest records it."""
    failed = {tid for tid, _, state, _ in states if state == "failed"}
    if (
        [name for name, g in gates.items() if not g["passed"]] != [dataset]
        or not failed
        or not failed <= EXPECTED_FAILED
        or "dataset.validate" not in failed
    ):
        return None
    gate = gates[dataset]
    skipped = sorted(tid for tid, _, state, _ in states if state == "upstream_failed")
    tracebacks = log_text.count("Traceback (most recent call last)")
    return (
        f"demo: dataset {dataset!r} failed its gate as meant: {'; '.join(gate['reasons'])} (report "
        f"{gate['report_uri']}). Its validate task failed, then {' and '.join(sorted(failed - {'dataset.validate'}))} "
        "refused a run with a failed gate"
        + (f", and {', '.join(skipped)} did not run" if skipped else "")
        + f": nothing was published for it, the gate at work. Airflow's log of this run ({tracebacks} "
        f"traceback(s), all from this failure) is in {os.path.relpath(log)}."
    )
