"""The overflow stage's requests: one attempt on the wire (`send`), and a sample's attempts until
an answer, a final failure or a stop (`sample`).

The SDK's own retries are off (`max_retries=0`): this one loop sees every attempt, so backoff
honours `Retry-After`, counts toward one limit and shows in the logs. An attempt's failure is
judged as a typed outcome (`openrouter_outcomes`) where it arises; one that may be billed is
priced by the ledger (`openrouter_attempts`) before the sample is asked again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from eagle3_data.retry import backoff_s
from eagle3_data.stages.generate.checkpoint import Prompt, generation_row
from eagle3_data.stages.generate.contracts import GenerationRow, StopReason
from eagle3_data.stages.generate.openrouter_attempts import AttemptLedger
from eagle3_data.stages.generate.openrouter_breaker import Breaker
from eagle3_data.stages.generate.openrouter_http import AttemptLost, Received, SdkPost
from eagle3_data.stages.generate.openrouter_outcomes import (
    Answer,
    AttemptOutcome,
    DispatchStop,
    Failed,
    LostAttempt,
    Prepared,
    ReadyPrompt,
    Refusal,
    Sent,
    TransportFailure,
)
from eagle3_data.stages.generate.openrouter_pricing import Prices, priced
from eagle3_data.stages.generate.openrouter_rows import SOURCE, failed_with
from eagle3_data.stages.generate.provider_answers import Verdict, body_error, classify_status, cost_unknown

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger(__name__)


class Sender:
    def __init__(
        self,
        *,
        stream: bool,
        concurrency: int,
        max_attempts: int,
        prices: Prices,
        cost_lookups: int,
        cost_lookup_delay_s: float,
        stop: DispatchStop,
        ledger: AttemptLedger,
        breaker: Breaker[Failed],
    ):
        self.stream, self.concurrency, self.max_attempts = stream, concurrency, max_attempts
        # an answer without a cost is priced from the config's prices only: the model list's are the
        # default provider's, another routed provider may charge more (they bound the budget's estimate)
        self.prices = prices
        self.cost_lookups, self.cost_lookup_delay_s = cost_lookups, cost_lookup_delay_s
        self.stop, self.ledger, self.breaker = stop, ledger, breaker
        self.paused_until = 0.0  # monotonic: no request leaves before (a 402 in-flight budget, a 429 hint)
        self._slots = asyncio.Semaphore(concurrency)  # at most `concurrency` requests on the wire

    def open_pass(self) -> None:
        """A semaphore is bound to the loop it first waits on: one per pass."""
        self._slots = asyncio.Semaphore(self.concurrency)

    async def send(self, client: SdkPost, ready: ReadyPrompt) -> Sent | None:
        """One attempt's request, holding one of the `concurrency` request slots while it is on the
        wire; None when the stage stopped before it left."""
        import openai

        if self.stop.stopped:
            return None
        if (wait := self.paused_until - time.monotonic()) > 0:
            await asyncio.sleep(wait)
            if self.stop.stopped:
                return None
        prompt, attempt_id, named = ready.prompt, uuid.uuid4().hex[:16], []

        def opened(generation_id: str | None) -> None:
            named.append(generation_id)
            self.ledger.opened(attempt_id, prompt.sample_id, generation_id, len(ready.prompt_ids))

        post = client.stream if self.stream else client.post
        async with self._slots:
            if self.stop.stopped:
                return None
            try:
                outcome: AttemptOutcome = await post(ready.body, _headers(prompt), opened)
            except openai.APIStatusError as exc:
                outcome = Refusal(classify_status(exc.status_code, _json_or_none(exc.response), exc.response.headers))
            except openai.APITimeoutError as exc:
                outcome = TransportFailure(f"transport: {type(exc).__name__}", timed_out=True)
            except openai.APIConnectionError as exc:
                outcome = TransportFailure(f"transport: {type(exc).__name__}", timed_out=False)
            except AttemptLost as lost:
                outcome = LostAttempt(lost.why, lost.generation_id)
        return Sent(attempt_id, bool(named), outcome)

    async def sample(self, client: SdkPost, prepared: Prepared, first: Sent | None) -> Answer | Failed | None:
        """The decoded answer with its price, a failure after retries, or None when the stage
        stops (the sample stays pending: nothing is recorded for it). `first`: the first attempt,
        sent by the worker (None: it was not sent)."""
        if not isinstance(prepared, ReadyPrompt):
            refused = generation_row(prepared.prompt, None, SOURCE, failed=f"chat template: {prepared.reason}")
            return Failed(refused, True)
        prompt = prepared.prompt
        verdict = Verdict("retry", "no attempt")
        for attempt in range(1, self.max_attempts + 1):
            sent = first if attempt == 1 else await self.send(client, prepared)
            if sent is None:
                return None
            judged = await self._judge(client, prepared, sent)
            if isinstance(judged, Answer):
                return judged
            verdict = judged
            if verdict.action == "stop":
                assert verdict.stop is not None  # a "stop" verdict names the stage's stopped_reason
                self.stop.stop(verdict.stop, verdict.reason)
                return None
            if verdict.action == "permanent":
                counted = None if verdict.prompt_specific else verdict.reason
                self.breaker.outcome(counted)
                return Failed(self._failed_row(prepared, verdict.reason), True, breaker=counted)
            if verdict.action == "pause":
                assert verdict.retry_after_s is not None  # a pause says how long
                self.paused_until = max(self.paused_until, time.monotonic() + verdict.retry_after_s)
                log.warning("%s: %s; pausing dispatch %.0f s", SOURCE, verdict.reason, verdict.retry_after_s)
            if attempt < self.max_attempts:
                log.debug("sample %s attempt %d: %s; retrying", prompt.sample_id, attempt, verdict.reason)
                retry_after = None if verdict.retry_after_s is None else str(verdict.retry_after_s)
                await asyncio.sleep(backoff_s(attempt, retry_after=retry_after))
        if verdict.stop in (StopReason.RATE_LIMITED, StopReason.IN_FLIGHT_BUDGET):
            # the service's limits, not this prompt's fault
            self.stop.stop(verdict.stop, f"{verdict.reason} (after {self.max_attempts} attempts)")
            return None
        self.breaker.outcome(None)
        return Failed(
            self._failed_row(prepared, f"gave up after {self.max_attempts} attempts: {verdict.reason}"), False
        )

    async def _judge(self, client: SdkPost, ready: ReadyPrompt, sent: Sent) -> Answer | Verdict:
        """One attempt's answer, priced, or the verdict on it; an attempt that may be billed without
        an answer is priced first (`AttemptLedger.lose`)."""
        sample_id, prompt_tokens, outcome = ready.prompt.sample_id, len(ready.prompt_ids), sent.outcome
        data: Any = None
        if isinstance(outcome, Received):
            try:
                data = outcome.answer()
            except AttemptLost as lost:
                outcome = LostAttempt(lost.why, lost.generation_id)
        if isinstance(outcome, Refusal):
            return outcome.verdict
        if isinstance(outcome, TransportFailure):
            if outcome.timed_out and not self.stream:  # a non-streamed generation stopped waiting for is billed
                await self.ledger.lose(
                    client, sample_id, prompt_tokens, sent.attempt_id, None, "timed out before the answer"
                )
            return Verdict("retry", outcome.reason)
        if isinstance(outcome, LostAttempt):
            await self.ledger.lose(
                client, sample_id, prompt_tokens, sent.attempt_id, outcome.generation_id, outcome.why
            )
            return Verdict("retry", outcome.why)
        if (verdict := body_error(data)) is not None and sent.named:
            gid = outcome.generation_id or (data.get("id") if isinstance(data, dict) else None)
            if isinstance(gid, str) and cost_unknown(data):  # may be billed: priced as a cut stream is
                await self.ledger.lose(client, sample_id, prompt_tokens, sent.attempt_id, gid, verdict.reason)
            else:  # its cost says nothing was billed, or no generation to look up
                self.ledger.closed(sent.attempt_id, sample_id)
        if verdict is not None:
            return verdict
        self.breaker.outcome(None)
        cost, source = await priced(client, data, self.prices, self.cost_lookups, self.cost_lookup_delay_s)
        return Answer(data, cost, source, self.ledger.take_lost(sample_id))

    def _failed_row(self, ready: ReadyPrompt, reason: str) -> GenerationRow:
        """A failed row carrying the attempts its sample lost (paid money the row accounts for)."""
        row = generation_row(ready.prompt, ready.prompt_ids, SOURCE, failed=reason)
        return failed_with(row, self.ledger.take_lost(ready.prompt.sample_id))


def _headers(prompt: Prompt) -> dict[str, Any]:
    """Dataset and sample id for the dev server's per-sample counters; providers ignore them."""
    return {"X-Eagle3-Dataset": prompt.dataset, "X-Eagle3-Sample-Id": prompt.sample_id}


def _json_or_none(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except Exception:
        return None
