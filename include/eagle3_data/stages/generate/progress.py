"""Progress of a generation stage: a tqdm bar for the CLI, steady log lines for Airflow.

An hours-long task must be readable from its log, so `LogProgress` writes one line every
`interval_s` seconds (done/total, failed, tokens/s, USD, ETA) even when nothing finished in between
(a stalled provider shows as a flat line, not as silence). Stage functions take any object with
`start`, `update`, `tick` and `close`; `close` is safe in any state (before `start`, twice), so a
stage with nothing to do, or one failing before its first round, ends cleanly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol


class ProgressSink(Protocol):
    """What a stage reports its progress to (a test's own sink, or a `Progress` below)."""

    def start(self, total: int, already_done: int = 0, label: str = "") -> None: ...

    def update(self, *, ok: int = 0, failed: int = 0, tokens: int = 0, cost_usd: float = 0.0) -> None: ...

    def tick(self) -> None: ...

    def close(self) -> None: ...


class Progress:
    """Counts shared by every progress sink; a plain `Progress()` records and shows nothing."""

    def __init__(self) -> None:
        self.total = self.done = self.failed = self.tokens = self._base = 0
        self.cost_usd = 0.0
        self.label = ""
        self.started = time.monotonic()

    def start(self, total: int, already_done: int = 0, label: str = "") -> None:
        self.total, self.done, self.label = total, already_done, label
        self._base = already_done
        self.started = time.monotonic()

    def update(self, *, ok: int = 0, failed: int = 0, tokens: int = 0, cost_usd: float = 0.0) -> None:
        self.done += ok + failed
        self.failed += failed
        self.tokens += tokens
        self.cost_usd += cost_usd

    def tick(self) -> None:
        """Called every second or so by the stage loop."""

    def close(self) -> None:
        pass

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (self.done - self._base) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = f"{eta / 60:.1f} min" if eta != float("inf") else "?"
        return (
            f"{self.label} {self.done}/{self.total} done, {self.failed} failed, "
            f"{self.tokens / elapsed:.0f} tokens/s, ${self.cost_usd:.4f}, ETA {eta_s}"
        )


async def tick_every(progress: ProgressSink, interval_s: float = 1.0) -> None:
    """The stage loop's ticker (both clients): `progress.tick()` every second until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        progress.tick()


class LogProgress(Progress):
    def __init__(self, logger: logging.Logger | None = None, interval_s: float = 30.0) -> None:
        super().__init__()
        self.log = logger or logging.getLogger("eagle3_data.stages.generate")
        self.interval_s = interval_s
        self._last = 0.0

    def start(self, total: int, already_done: int = 0, label: str = "") -> None:
        super().start(total, already_done, label)
        self._last = time.monotonic()
        self.log.info("%s: %d samples, %d already committed", label, total, already_done)

    def tick(self) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self._last = time.monotonic()
            self.log.info(self.line())

    def close(self) -> None:
        self.log.info("finished: " + self.line())


class TqdmProgress(Progress):
    def start(self, total: int, already_done: int = 0, label: str = "") -> None:
        from tqdm import tqdm

        super().start(total, already_done, label)
        self.bar = tqdm(total=total, initial=already_done, desc=label, unit="sample", dynamic_ncols=True)

    def update(self, *, ok: int = 0, failed: int = 0, tokens: int = 0, cost_usd: float = 0.0) -> None:
        super().update(ok=ok, failed=failed, tokens=tokens, cost_usd=cost_usd)
        self.bar.update(ok + failed)
        self.bar.set_postfix(failed=self.failed, usd=f"{self.cost_usd:.4f}", refresh=False)

    def close(self) -> None:
        """Safe in any state: a stage with nothing to do never started its bar."""
        if getattr(self, "bar", None) is not None:
            self.bar.close()
            self.bar = None
