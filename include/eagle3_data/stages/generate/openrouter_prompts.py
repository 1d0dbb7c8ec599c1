"""The overflow stage's pending prompts, made ready ahead of the send path.

The template render is ~40% of the client's CPU per request; done on the send path it held back
0.05 of C/L (benchmarks/overflow_client.py). The settler renders the next prompts when no answer
waits (`prepare`, up to `lookahead`), and a worker renders one itself only when none is ready.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.stages.generate.checkpoint import Prompt
from eagle3_data.stages.generate.openrouter_outcomes import Prepared, ReadyPrompt, RefusedPrompt
from eagle3_data.stages.generate.openrouter_rows import RequestShape


class PromptFeed:
    def __init__(self, fmt: OutputFormat, shape: RequestShape, lookahead: int):
        self.fmt, self.shape, self.lookahead = fmt, shape, lookahead
        self._pending: Iterator[Prompt] = iter(())  # the pending prompts not yet made ready
        self._ready: deque[Prepared] = deque()

    def open(self, pending: Iterable[Prompt]) -> None:
        """One pass's prompts (each round's pass starts from the stage's pending ones)."""
        self._pending, self._ready = iter(pending), deque()

    def wants_more(self) -> bool:
        return len(self._ready) < self.lookahead

    def prepare(self) -> bool:
        """Make the next pending prompt ready for its request (ids rendered, body encoded); False
        when none is left. A prompt the template refuses becomes a `RefusedPrompt`."""
        prompt = next(self._pending, None)
        if prompt is None:
            return False
        try:
            prepared: Prepared = ReadyPrompt(
                prompt,
                self.fmt.generation_prompt_ids(prompt.messages, prompt.tools, prompt.images),
                json.dumps(self.shape.body(prompt)).encode(),
            )
        except Exception as exc:
            prepared = RefusedPrompt(prompt, str(exc))
        self._ready.append(prepared)
        return True

    def take(self) -> Prepared | None:
        """A ready prompt; rendered now when the settler had no idle moment to do it ahead."""
        if not self._ready:
            self.prepare()
        return self._ready.popleft() if self._ready else None

    def put_back(self, prepared: Prepared) -> None:
        """Not sent (the budget held it back): the next worker, or attempt, takes it first."""
        self._ready.appendleft(prepared)
