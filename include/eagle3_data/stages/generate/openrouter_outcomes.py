"""What the overflow stage's parts hand each other: a prompt made ready (or refused), an attempt's
outcome off the wire, a sample's settled result, and the one switch that stops dispatch.

Each failure is a small typed value made where it arises, never an exception kept in a field:
the retry loop (`openrouter_send`) matches on the type, the settler (`openrouter_settle`) on
`Answer | Failed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from eagle3_data.stages.generate.checkpoint import Prompt
from eagle3_data.stages.generate.contracts import GenerationRow, StopReason
from eagle3_data.stages.generate.openrouter_http import Received
from eagle3_data.stages.generate.openrouter_rows import SOURCE
from eagle3_data.stages.generate.provider_answers import Verdict

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReadyPrompt:
    """A pending prompt made ready off the send path: its ids and its request body, encoded."""

    prompt: Prompt
    prompt_ids: list[int]
    body: bytes
    estimate: float = 0.0  # what the budget reserves for it while it is in flight (set when dispatched)


@dataclass(frozen=True, slots=True)
class RefusedPrompt:
    """A pending prompt the chat template refuses: a permanent failed row, never a request."""

    prompt: Prompt
    reason: str
    estimate: ClassVar[float] = 0.0  # never sent: the budget reserves nothing for it


Prepared = ReadyPrompt | RefusedPrompt


@dataclass(frozen=True, slots=True)
class Refusal:
    """The provider answered an attempt with an error status, judged (`classify_status`)."""

    verdict: Verdict


@dataclass(frozen=True, slots=True)
class TransportFailure:
    """No answer came: the connection failed, or the request timed out (`timed_out`; a
    non-streamed one the provider may still bill)."""

    reason: str
    timed_out: bool


@dataclass(frozen=True, slots=True)
class LostAttempt:
    """An attempt that reached the provider and may be billed, without a usable answer (a cut
    stream, an unreadable body); `generation_id` prices it."""

    why: str
    generation_id: str | None


AttemptOutcome = Received | Refusal | TransportFailure | LostAttempt


@dataclass(frozen=True, slots=True)
class Sent:
    """One attempt's request off the wire: its outcome and whether the provider named its
    generation (it may be billed)."""

    attempt_id: str
    named: bool
    outcome: AttemptOutcome


@dataclass(frozen=True, slots=True)
class Failed:
    """A failed sample's row. `permanent`: final now (the same request fails again); `breaker`:
    the error text the circuit breaker compares (None: it does not count)."""

    row: GenerationRow
    permanent: bool
    breaker: str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """A decoded answer body, its price (USD and where it came from; None: not known) and the
    attempts its sample lost before it."""

    data: dict[str, Any]
    cost: float | None
    cost_source: str | None
    lost: list[dict[str, Any]]


class Finished(NamedTuple):
    """A sample handed to the settler: its result (None: the stage stopped before it was
    judged; it stays pending) and the seconds from its first request."""

    prepared: Prepared
    result: Answer | Failed | None
    latency_s: float


class DispatchStop:
    """Why dispatch stopped (the first reason wins), with the provider's words for it: every part
    checks it before sending more."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None
        self.detail: str | None = None

    @property
    def stopped(self) -> bool:
        return self.reason is not None

    def stop(self, reason: StopReason, detail: str | None) -> None:
        """Stop dispatching: the workers send nothing more after their request in flight."""
        if self.reason is None:
            self.reason, self.detail = reason, detail
            log.error("%s: stopping dispatch (%s)%s", SOURCE, reason, f": {detail}" if detail else "")
