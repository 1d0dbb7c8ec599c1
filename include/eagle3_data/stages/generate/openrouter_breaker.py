"""The overflow stage's circuit breaker: a config the provider refuses stops dispatch, not the dataset.

`max_identical_errors` identical permanent errors in a row (a 400 for a parameter the provider
refuses, a 404 for the model) mean every request would fail the same way: dispatch stops with
that error and the samples that got it stay pending, so a rerun after the fix generates them.
Only errors that say nothing about the prompt count: a moderation or guardrail block, or a
prompt too large (`Verdict.prompt_specific`), is that prompt's own and never trips it (ten
flagged prompts in a row are ten failed prompts, not a broken config).

Outcomes are counted as they come back (`outcome`), so it trips after at most `concurrency - 1`
more requests; the failures are held (`hold`) until the run of identical errors is broken by
another outcome (`release`: they were the prompts' own after all) or trips it. After a trip
nothing is released, whatever the requests still in flight return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Breaker(Generic[T]):
    def __init__(self, limit: int, on_trip: Callable[[str, int], None]):
        self.limit, self.on_trip = limit, on_trip
        self.tripped: str | None = None  # the error that tripped it
        self._last: tuple[str | None, int] = (None, 0)  # the last outcome's error and its run
        self._held: list[tuple[str, T]] = []

    def outcome(self, error: str | None) -> None:
        """One request's outcome as it comes back: a counted error's text, or None for any other."""
        last, run = self._last
        run = run + 1 if error is not None and error == last else int(error is not None)
        self._last = (error, run)
        if run >= self.limit and self.tripped is None and error is not None:
            self.tripped = error
            self.on_trip(error, run)

    def hold(self, error: str, item: T) -> list[T]:
        """Hold a counted failure; returns the failures released by it (a different error ends
        the run before it)."""
        released = self.release() if self._held and self._held[0][0] != error and self.tripped is None else []
        self._held.append((error, item))
        return released

    def release(self) -> list[T]:
        """The held failures, as their prompts' own; none once tripped (they stay pending)."""
        if self.tripped is not None:
            return []
        held, self._held = self._held, []
        return [item for _, item in held]
