"""Long-running children of a launcher (`make airflow`, `make cluster`): one process group each,
all stopped together however the launcher is asked to stop.

Why process groups: Airflow's api-server, scheduler and Celery workers fork workers of their
own, and Postgres forks a backend per connection. Signalling only the PID we started leaves those
running, re-parented to PID 1 with their ports open. Each child is started in a new session
(its own group, and out of reach of the terminal's Ctrl-C, which only the launcher should see),
and stopping sends the signal to the whole group, then SIGKILL after a grace period.

Why signal handlers: Python turns only SIGINT into an exception. SIGTERM (what `kill`, systemd
and CI send) and SIGHUP (a closed terminal or SSH session) would end the launcher without
running its `finally` blocks, so `stop_on_signals()` turns both into `Stop`, an exception that
unwinds through the same cleanup as Ctrl-C.

The group ids are kept in a state file, so a launcher that was SIGKILLed (no cleanup possible)
has its leftovers removed by the next start on the same work directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_data.dev.processes import log_tail
from eagle3_data.errors import UserError

log = logging.getLogger(__name__)


class Stop(Exception):
    """The launcher received SIGTERM or SIGHUP: unwind and stop everything."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Stop` and SIGINT KeyboardInterrupt, once: later
    signals are ignored, so a second Ctrl-C or TERM cannot cut the cleanup the first one started."""

    def handler(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stop(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_launcher(name: str, serve: Callable[[], int]) -> int:
    """`make {name}`'s main loop: `serve()` under `stop_on_signals`; Ctrl-C, SIGTERM or SIGHUP stop
    everything and exit 0, a setup error is one line and exit 2."""
    from eagle3_data.errors import UserError

    with stop_on_signals():
        try:
            return serve()
        except (KeyboardInterrupt, Stop) as exc:
            print(f"\n{name}: {type(exc).__name__} {exc}: stopped everything", flush=True)
            return 0
        except UserError as exc:
            print(f"make {name}: error: {exc}", file=sys.stderr)
            return 2


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Signal the group, wait up to `grace` s for all its members to exit, then SIGKILL the rest."""
    stop_groups([(pgid, sig)], grace)


def stop_groups(groups: list[tuple[int, int]], grace: float) -> None:
    """Signal each (pgid, signal) at once; all share one grace period, then whatever is left of
    them gets SIGKILL (and 10 s more to be gone)."""
    _signal_groups(groups)
    _wait_gone([pgid for pgid, _ in groups], grace)
    left = [pgid for pgid, _ in groups if group_members(pgid)]
    _signal_groups([(pgid, signal.SIGKILL) for pgid in left])
    _wait_gone(left, 10)


def _signal_groups(groups: list[tuple[int, int]]) -> None:
    for pgid, sig in groups:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pgids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(group_members(pgid) for pgid in pgids) and time.monotonic() < deadline:
        time.sleep(0.05)


def reap_leftovers(state_file: Path) -> list[str]:
    """SIGKILL the groups a previous launcher on this work dir recorded and did not stop."""
    if not state_file.exists():
        return []
    left = []
    for name, info in json.loads(state_file.read_text()).items():
        if group_members(info["pgid"]):
            kill_group(info["pgid"], signal.SIGKILL, grace=0)
            left.append(name)
    state_file.unlink()
    return left


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    log_path: Path
    stop_signal: int = signal.SIGTERM
    grace: float = 10.0
    cwd: Path | None = None
    infrastructure: bool = False  # stopped after the others (see Services.stop_all)
    proc: subprocess.Popen | None = None


class Services:
    """Start children in their own groups; stop them all, the infrastructure last."""

    def __init__(self, log_dir: Path, state_file: Path) -> None:
        self.log_dir = log_dir
        self.state_file = state_file
        self.services: dict[str, Service] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        user: str | None = None,
        stop_signal: int = signal.SIGTERM,
        grace: float = 10.0,
        cwd: Path | None = None,
        infrastructure: bool = False,
    ) -> Service:
        """Start `argv` (as `user` through runuser, when given and we are root) in a new session."""
        if user and os.geteuid() == 0:
            argv = ["runuser", "-u", user, "--", *argv]
        svc = Service(name, list(argv), env, self.log_dir / f"{name}.log", stop_signal, grace, cwd, infrastructure)
        self.services[name] = svc
        self._spawn(svc)
        return svc

    def _spawn(self, svc: Service) -> None:
        with open(svc.log_path, "ab") as out:
            svc.proc = subprocess.Popen(
                svc.argv,
                env=svc.env,
                cwd=svc.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._save()

    def restart(self, name: str) -> Service:
        """Stop (if still running) and start again with the same command: a crashed worker's replacement."""
        svc = self.services[name]
        self._stop(svc)
        self._spawn(svc)
        return svc

    def kill(self, name: str) -> None:
        """SIGKILL the service's whole group at once, as a crash or the OOM killer would."""
        kill_group(self.services[name].proc.pid, signal.SIGKILL, grace=0)
        self.services[name].proc.wait()

    def forget(self, name: str) -> Service:
        """Stop supervising a one-shot child that has ended (a migration): it is not a dead service."""
        svc = self.services.pop(name)
        self._save()
        return svc

    def dead(self) -> list[str]:
        return [n for n, s in self.services.items() if s.proc.poll() is not None]

    def raise_if_dead(self, waiting_for: str, *, ignore: str | None = None) -> None:
        """Raise UserError naming the first service (but `ignore`) that has exited, with its code
        and its log's last lines: a failed start then says which process failed, and why."""
        for name in self.dead():
            if name != ignore:
                svc = self.services[name]
                raise UserError(
                    f"{name} exited with code {svc.proc.returncode} while waiting for {waiting_for}; "
                    f"the end of {svc.log_path}:\n{log_tail(svc.log_path)}"
                )

    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.services.values()]

    def pids(self) -> dict[str, int]:
        return {n: s.proc.pid for n, s in self.services.items()}

    def stop_all(self) -> None:
        """Stop every service: first all those started without `infrastructure`, together, then
        the infrastructure (a database, a broker) they may still talk to while they shut down.
        One wave's groups get their signals at once and share one grace period: one by one, the
        grace periods of a slow-to-exit api-server, scheduler and two workers would add up."""
        services = list(reversed(self.services.values()))
        for wave in ([s for s in services if not s.infrastructure], [s for s in services if s.infrastructure]):
            stop_groups([(s.proc.pid, s.stop_signal) for s in wave], max((s.grace for s in wave), default=0))
            for svc in wave:
                self._reap(svc)
        self.state_file.unlink(missing_ok=True)

    def _reap(self, svc: Service) -> None:
        try:
            svc.proc.wait(5)
        except subprocess.TimeoutExpired:
            svc.proc.kill()
            svc.proc.wait()

    def _stop(self, svc: Service) -> None:
        kill_group(svc.proc.pid, svc.stop_signal, svc.grace)  # the leader may be gone while its group lives
        self._reap(svc)

    def _save(self) -> None:
        state = {n: {"pgid": s.proc.pid, "argv": s.argv[:4]} for n, s in self.services.items() if s.proc}
        self.state_file.write_text(json.dumps(state, indent=1))

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
