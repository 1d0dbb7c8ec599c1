"""A test that times out leaves where it stuck: stacks of this process and of every process it
started, and the logs of the services it ran, under `test-artifacts/hangs/<test>/`, printed too.

It replaces pytest-timeout's timer (its `pytest_timeout_set_timer` hook) for the main thread:
pytest-timeout's default SIGALRM is the signal Airflow's `execution_timeout` takes inside
`dag.test()`, which would silently cancel the test's own deadline. Here a watchdog thread
fires at the deadline, writes the report, then interrupts the test with a signal of its own
(the test fails, the session goes on); if the test still does not end within GRACE_S, the
process exits as pytest-timeout's thread method would, so a run can never hang.

Stacks: `faulthandler` for this process, `py-spy dump` for its descendants (requirements.txt
pins it; without it, their command lines and kernel wait channels only). Logs: fixtures name
their folders with `watch_logs(path)`; files changed since the test started are copied.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS") or REPO / "test-artifacts")
SIGNAL = signal.SIGRTMIN + 3  # no library here uses it (Airflow: SIGALRM, SIGUSR2; Celery: SIGUSR1)
GRACE_S = 60.0
LOG_TAIL_BYTES = 256 * 1024
PRINT_BYTES = 24 * 1024

_LOG_DIRS: list[tuple[Path, str]] = []


def watch_logs(path: str | os.PathLike, pattern: str = "*.log") -> None:
    """Copy the files matching `pattern` in this folder (recursively) that changed during a test
    that times out into its report."""
    _LOG_DIRS.append((Path(path), pattern))


class TestTimedOut(pytest.fail.Exception):
    """Raised in the test's thread at its deadline."""


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.timeout <= 0 or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer
    started = time.time()

    def interrupt(signum, frame):
        raise TestTimedOut(f"Timeout (>{settings.timeout:g} s): stacks and logs in {_report_dir(item)}", pytrace=False)

    previous = signal.signal(SIGNAL, interrupt)
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(settings.timeout):
            return
        report(item, started, settings.timeout)
        if signal.getsignal(SIGNAL) is interrupt:
            signal.pthread_kill(threading.main_thread().ident, SIGNAL)
        if done.wait(GRACE_S):
            return
        sys.__stderr__.write(f"\n{item.nodeid}: still running {GRACE_S:g} s after its timeout; exiting\n")
        sys.__stderr__.flush()
        os._exit(1)

    thread = threading.Thread(target=watchdog, name=f"hang-report {item.nodeid}", daemon=True)

    def cancel() -> None:
        done.set()
        thread.join(timeout=5)
        signal.signal(SIGNAL, previous)

    item.cancel_timeout = cancel
    thread.start()
    return True


def _report_dir(item) -> Path:
    return ARTIFACTS / "hangs" / re.sub(r"[^A-Za-z0-9._-]+", "_", item.nodeid)[:150]


def report(item, started: float, timeout: float) -> Path:
    """Write and print what every process of the test was doing, and the services' logs."""
    out = _report_dir(item)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with open(out / f"stacks-pytest-{os.getpid()}.txt", "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    children = descendants(os.getpid())
    py_spy = shutil.which("py-spy") or (shutil.which("py-spy", path=str(Path(sys.executable).parent)))
    with ThreadPoolExecutor(8) as pool:
        dumps = list(pool.map(lambda pid: _stack(pid, py_spy), children))
    summary = [
        f"{item.nodeid} timed out after {timeout:g} s; {len(children)} descendant process(es); "
        f"stacks by {'py-spy' if py_spy else 'nothing (py-spy not installed): command lines only'}"
    ]
    for pid, text in zip(children, dumps):
        (out / f"stacks-{pid}.txt").write_text(text)
        summary.append(f"  pid {pid}: {_cmdline(pid)[:160]}")
    copied = _copy_logs(out / "logs", started)
    (out / "summary.txt").write_text("\n".join(summary + [f"  logs: {n}" for n in copied]) + "\n")
    _print(out, summary, copied)
    return out


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc (children of children included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = sorted(pid for pid, ppid in parents.items() if ppid == parent)
        found += kids
        frontier += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _stack(pid: int, py_spy: str | None) -> str:
    head = f"pid {pid}: {_cmdline(pid)}\n"
    try:
        state = next(
            (line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")), ""
        )
        head += f"{state}; wchan {Path(f'/proc/{pid}/wchan').read_text().strip() or '-'}\n"
    except OSError:
        return head + "(gone)\n"
    if py_spy is None:
        return head
    try:
        done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        return head + (done.stdout or "") + (done.stderr or "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return head + f"py-spy failed: {exc}\n"


def _copy_logs(dest: Path, since: float) -> list[str]:
    copied = []
    for root, pattern in _LOG_DIRS:
        if not root.exists():
            continue
        for path in [root] if root.is_file() else sorted(p for p in root.rglob(pattern) if p.is_file()):
            try:
                if path.stat().st_mtime < since:
                    continue
                rel = path.name if path == root else str(path.relative_to(root))
                target = dest / root.name / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with path.open("rb") as f:
                    f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                    target.write_bytes(f.read())
                copied.append(str(target.relative_to(dest.parent)))
            except OSError:
                continue
    return copied


def _print(out: Path, summary: list[str], copied: list[str]) -> None:
    """The report on the real stderr (pytest captures sys.stderr), stacks first, cut to PRINT_BYTES."""
    text = "\n".join(summary) + f"\nreport: {out}\n"
    for path in sorted(out.glob("stacks-*.txt")):
        text += f"\n--- {path.name} ---\n{path.read_text(errors='replace')}"
    if copied:
        text += "\nlogs copied: " + ", ".join(copied[:20]) + ("" if len(copied) <= 20 else f" (+{len(copied) - 20})")
    if len(text) > PRINT_BYTES:
        text = text[:PRINT_BYTES] + f"\n... (cut; all of it under {out})"
    sys.__stderr__.write("\n" + "=" * 30 + " HANG REPORT " + "=" * 30 + "\n" + text + "\n")
    sys.__stderr__.flush()
