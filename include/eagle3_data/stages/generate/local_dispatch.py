"""The local stage's pending prompts, shared by every endpoint's workers.

Fresh prompts come from the stage's one-shot iterator as workers free up (only the prompts in
flight are decoded); the queue holds those handed back for another try (a transport failure, a
full engine, a dropped endpoint's), which any endpoint may take. The pass is done when every
pending sample is settled, or when it is stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from eagle3_data.stages.generate.checkpoint import Prompt


class Attempt(NamedTuple):
    """A pending prompt and how many of its attempts failed before."""

    prompt: Prompt
    failed: int


class PendingPrompts:
    def __init__(self) -> None:
        self._fresh: Iterator[Prompt] | None = None
        self._retries: asyncio.Queue[Attempt] = asyncio.Queue()
        self.outstanding = 0  # pending samples not yet settled
        self.done = asyncio.Event()
        self.error: Exception | None = None  # the local spill could not be read

    def open(self, pending: Iterable[Prompt], count: int) -> None:
        """One pass's prompts; a queue or event is bound to the loop it first waits on."""
        self._fresh, self.outstanding = iter(pending), count
        self._retries, self.done = asyncio.Queue(), asyncio.Event()

    async def take(self) -> Attempt:
        """The next fresh prompt, then (once none is left) those put back: the order of one FIFO
        queue holding every pending prompt, without decoding them all up front."""
        if self._fresh is not None:
            try:
                prompt = next(self._fresh, None)
            except Exception as exc:  # the local spill is unreadable: stop the stage, do not hang it
                self.error, self._fresh = exc, None
                self.done.set()
                raise
            if prompt is not None:
                return Attempt(prompt, 0)
            self._fresh = None
        return await self._retries.get()

    def put_back(self, attempt: Attempt) -> None:
        """For another try, on any endpoint."""
        self._retries.put_nowait(attempt)

    def settled(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.done.set()
