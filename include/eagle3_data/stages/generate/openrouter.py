"""Overflow generation: OpenRouter chat completions (text only), bounded, budgeted, resumable.

The stage's parts, one unit each, so the next provider shape changes one place:
  openrouter_http     the wire: plain or streamed (SSE) requests, OpenRouter's tables;
  openrouter_rows     the request body (the history in OpenRouter's documented fields) and the row of an answer;
  openrouter_pricing  an answer's cost and the per-token prices;
  openrouter_budget   the spend cap, from prices x tokens;
  openrouter_breaker  the circuit breaker for a config the provider refuses;
  this module         dispatch: workers, retries, the settler that journals and checkpoints.
The SDK's own retries are off (`max_retries=0`): one retry loop here sees every attempt, so
backoff honours `Retry-After`, counts toward one limit and shows in the logs. Answers are text;
`output_ids` stay null until the reconstruction stage. What is paid is never lost (see
checkpoint.py), and what may be paid is counted: a request that reached the provider without
giving an answer (a cut stream, an errored one without a cost, an unreadable body, a timed-out
request) is priced (from OpenRouter's record of its generation, else at the budget's estimate)
and journaled before its sample is asked again; one priced at the estimate is looked up again
before the manifest is written (`record_wait_s`), as OpenRouter's record often lands seconds late.
The API key is passed in by the caller (the DAG reads the Airflow connection) and only ever
handed to the SDK: it is in no row, manifest, log line or exception message produced here.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.config import OverflowGenerationConfig, options_of
from eagle3_data.errors import UserError
from eagle3_data.images import read_image
from eagle3_data.retry import backoff_s
from eagle3_data.stages.generate.alarm import with_alarm_outside_callbacks
from eagle3_data.stages.generate.checkpoint import (
    Prompt,
    StageRun,
    StageSetup,
    generation_row,
    parse_prompts,
    reused_summary,
    run_rounds,
)
from eagle3_data.stages.generate.contracts import GenerationRow, StageSummary, StopReason
from eagle3_data.stages.generate.openrouter_breaker import Breaker
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_http import AttemptLost, Received, SdkPost
from eagle3_data.stages.generate.openrouter_pricing import Prices, listed_prices, price_answer, priced
from eagle3_data.stages.generate.openrouter_rows import (
    REQUEST_FIELDS,
    SOURCE,
    RequestShape,
    RowContext,
    answer_row,
    failed_with,
    request_sampling,
)
from eagle3_data.stages.generate.progress import Progress, ProgressSink, tick_every
from eagle3_data.stages.generate.provider_answers import Verdict, body_error, classify_status, cost_unknown
from eagle3_data.stages.generate.provider_identity import (
    Pin,
    allowed_providers,
    model_names,
    provider_slugs,
)

log = logging.getLogger(__name__)

ROUTES = ("overflow", "both")
__all__ = [
    "OverflowOptions",
    "OverflowRequest",
    "check_sampling",
    "generate_overflow",
    "price_answer",
    "request_sampling",
]


def check_sampling(sampling: Mapping[str, Any], *, where: str = "generation.sampling") -> dict:
    """The sampling params this client sends; any other key is refused before a request (a key
    silently dropped would make the overflow share sample differently from the local one)."""
    for key in sampling:
        if key not in REQUEST_FIELDS:
            raise UserError(
                f"{where}: {key!r} is not a sampling parameter the OpenRouter client sends; "
                f"accepted: {', '.join(REQUEST_FIELDS)}"
            )
    return dict(sampling)


@dataclass(frozen=True)
class OverflowRequest:
    """What every sample of the stage asks the provider for: part of the stage's params."""

    model: str  # OpenRouter model slug
    provider: Mapping[str, Any] = field(default_factory=dict)  # routing: order, allow_fallbacks, quantizations, ...
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, top_p, max_new_tokens, seed
    reasoning: Mapping[str, Any] | None = None  # OpenRouter's `reasoning` object; None: {"enabled": thinking}


@dataclass(frozen=True)
@options_of(OverflowGenerationConfig)
class OverflowOptions:
    """How the overflow client runs: `generation.overflow` of the config (`config.options_from`),
    with timings a test or benchmark may tighten."""

    # generation.overflow: the defaults are the config's (config.options_of)
    concurrency: int
    rows_per_part: int
    max_usd: float | None  # stop dispatching before spent + in flight would pass it; None: no cap
    price_usd_per_mtok: Mapping[str, float] | None  # prices answers that carry no usage.cost
    stream: bool  # SSE requests: bounded by silence, named when they open (openrouter_http)
    stream_idle_timeout_s: float
    request_timeout_s: float  # a non-streamed request's whole answer
    unreachable_timeout_s: float
    connect_timeout_s: float
    max_identical_errors: int  # this many identical permanent errors in a row stop dispatch
    record_wait_s: float  # at the stage's end: how long to wait for the records of attempts priced at the estimate
    # the client's own
    max_attempts: int = 6
    first_cost_estimate_usd: float = 0.01
    flush_interval_s: float = 30.0
    cost_lookups: int = 4  # GET /generation?id= tries for an answer without usage.cost (its record lags)
    cost_lookup_delay_s: float = 0.5  # the first wait; doubled after each 404


def generate_overflow(
    store,
    ref,
    prompts: Iterable[dict],
    fmt: OutputFormat,
    base_url: str,
    api_key: str,
    request: OverflowRequest,
    *,
    options: OverflowOptions = OverflowOptions(),
    setup: StageSetup = StageSetup(),
) -> StageSummary:
    """Generate every pending prompt of `ref.dataset` (routes overflow|both) through OpenRouter;
    its summary.

    `fmt`: the output format bound to the generation mode (its prompt ids price the budget's
    estimate; `reasoning` follows its mode unless the request sets it).
    stopped_reason (a StopReason, with `stop_detail`, the provider's words, when it answered): None (complete);
    "budget"; "credits" (402 out of credits), "unauthorized" (401), "forbidden" (403: a key limit,
    a workspace budget), "repeated_error" (`max_identical_errors` identical permanent errors in a
    row: a config the provider refuses), "unpriced_answer" (no cost in the answer, none at
    /generation and no configured price, while a budget binds): a person must act; and
    "rate_limited", "in_flight_budget" (429s, or 402s for the in-flight budget, past every retry),
    "retryable_failures": they pass, the next attempt resumes.
    `setup.rerun` regenerates a complete stage: answers still in the local journal are replayed
    first (never paid twice), the rest is requested again.
    """
    from eagle3_data.tokenizer import tokenizer_hashes

    if store.is_complete(ref) and not setup.rerun:
        return reused_summary(store, ref)
    if not api_key:
        raise UserError(
            "generate_overflow: no API key (set the openrouter connection's password or OPENROUTER_API_KEY)"
        )
    sampling = check_sampling(request.sampling)
    reasoning = dict(request.reasoning or {"enabled": fmt.thinking})
    params = {
        "source": SOURCE,
        "model": request.model,
        "provider": dict(request.provider),
        "sampling": dict(sampling, thinking=fmt.thinking),
        "reasoning": reasoning,
        "base_url": base_url,
    }
    rows = parse_prompts(prompts, ref.dataset, setup.routes if setup.routes is not None else ROUTES)
    progress = setup.progress or Progress()  # closed by run_rounds
    with StageRun(
        store,
        ref,
        rows,
        params,
        tokenizer_hashes(fmt.tokenizer),
        setup,
        rows_per_part=options.rows_per_part,
        flush_interval_s=options.flush_interval_s,
    ) as run:
        budget = Budget(
            options.max_usd,
            run.spent_before_usd,
            max_new_tokens=sampling.get("max_new_tokens"),
            prices=Prices.per_mtok(options.price_usd_per_mtok),
            first_estimate_usd=options.first_cost_estimate_usd,
        )
        client = _OverflowRun(
            run,
            fmt,
            base_url,
            api_key,
            replace(request, sampling=sampling, reasoning=reasoning),
            options,
            progress,
            budget,
        )
        with fewer_gc_pauses():
            stopped = run_rounds(
                run, ref.dataset, lambda: run_event_loop(client.run()), progress, f"generate_overflow {ref.dataset}"
            )
        if stopped is None:  # the manifest comes next: the estimates' records, if they appeared meanwhile
            run_event_loop(client.reprice_estimates())
        run.finish(
            stopped,
            extra={
                "budget_usd": options.max_usd,
                "spent_total_usd": round(client.budget.spent, 6),
                "lost_attempts_priced": client.attempts_priced(),
                "identity_pin": client.pin.to_json() if client.pin else None,
                **client.timing(),
            },
            stop_detail=client.stop_detail,
        )
    return run.result


@contextmanager
def fewer_gc_pauses(threshold: tuple[int, int, int] = (50_000, 20, 1000)):
    """Rarer garbage collections while the client runs. With the default thresholds (700, 10, 10)
    the answers' JSON made a young collection every few answers and a full one (every tracked
    object of the process: tokenizer, template, SDK, pydantic models) every ~second, each a
    pause of 20-400 ms in which no answer was read and no request sent: 1.8-3.5 s of a 9 s run
    at C=256 (benchmarks/overflow_client.py). Objects alive before the run are frozen out of the
    collections, unless the host process froze some itself (its freeze is left as it is); the
    thresholds are restored after the run."""
    saved, ours = gc.get_threshold(), gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    gc.set_threshold(*threshold)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        if ours:
            gc.unfreeze()


def run_event_loop(coro):
    """Run the client on uvloop (pinned in requirements.txt), else the stdlib loop: uvloop's
    C event loop takes ~0.1-0.3 ms less client CPU per request at C=256 (benchmarks/overflow_client.py).
    The loop takes SIGALRM meanwhile, so that an execution timeout is not lost in a callback (alarm.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(with_alarm_outside_callbacks(coro))
    return uvloop.run(with_alarm_outside_callbacks(coro))


@dataclass(slots=True)
class _Ready:
    """A pending prompt made ready off the send path: its ids (or the template's refusal) and
    its request body, encoded."""

    prompt: Prompt
    prompt_ids: list[int] | Exception
    body: bytes
    estimate: float  # what the budget reserves for it while it is in flight


@dataclass(slots=True)
class _Failed:
    """A failed sample's row. `permanent`: final now (the same request fails again); `breaker`:
    the error text the circuit breaker compares (None: it does not count)."""

    row: GenerationRow
    permanent: bool
    breaker: str | None = None


@dataclass(slots=True)
class _Answer:
    """A decoded answer body, its price (USD and where it came from; None: not known) and the
    attempts its sample lost before it."""

    data: dict
    cost: float | None
    cost_source: str | None
    lost: list[dict]


@dataclass(slots=True)
class _Sent:
    """One attempt's request off the wire: its answer read (not decoded) or the exception that
    ended it, and whether the provider named its generation (it may be billed)."""

    attempt_id: str
    named: bool
    outcome: Received | Exception


class _OverflowRun:
    """Dispatch: `concurrency` workers send, one settler records (`run`)."""

    def __init__(
        self,
        run: StageRun,
        fmt: OutputFormat,
        base_url: str,
        api_key: str,
        request: OverflowRequest,
        options: OverflowOptions,
        progress: ProgressSink,
        budget: Budget,
    ):
        self.stage, self.fmt, self.base_url, self._key = run, fmt, base_url, api_key
        self.model, self.provider = request.model, dict(request.provider)
        self.shape = RequestShape(
            request.model,
            self.provider,
            dict(request.reasoning),
            dict(request.sampling),
            options.stream,
            lambda ref: read_image(run.store, ref),
        )
        self.o, self.concurrency, self.max_attempts = options, options.concurrency, options.max_attempts
        self.progress, self.budget = progress, budget
        # an answer without a cost is priced from the config's prices only: the model list's are the
        # default provider's, another routed provider may charge more (they bound the budget's estimate)
        self.configured_prices = Prices.per_mtok(options.price_usd_per_mtok)
        self.breaker: Breaker[_Failed] = Breaker(options.max_identical_errors, self._tripped)
        self.lost: dict[str, list[dict]] = {sid: list(a) for sid, a in run.lost_attempts.items()}
        # every priced attempt without an answer this process knows (an earlier process's too): the
        # ones at the estimate are looked up again at the end (`reprice_estimates`)
        self.settled: list[dict] = [a for attempts in run.lost_attempts.values() for a in attempts]
        self._earlier = {a.get("attempt") for a in self.settled}
        self.repriced: list[dict] = []
        self.in_flight = 0
        self.stopped: StopReason | None = None
        self.stop_detail: str | None = None  # the provider's words for the stop
        self.pin: Pin | None = None
        self.rows = RowContext(
            request.model, self.provider, dict(request.sampling), fmt.thinking, run.tokenizer_sha256, None
        )
        self.paused_until = 0.0  # monotonic: no request leaves before (a 402 in-flight budget, a 429 hint)
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()
        # one pass's (`run`: once per round, each round on an event loop of its own)
        self._prompts: Iterator[Prompt] = iter(())  # the pending prompts not yet made ready
        self._ready: deque[_Ready] = deque()  # made ready ahead (the settler does it when idle)
        self._lookahead = 2 * self.concurrency  # how many: a burst's worth, and the next
        self._answers: asyncio.Queue[tuple[_Ready, _Answer | _Failed | None, float] | None] = asyncio.Queue()
        # at most C requests on the wire, and C more samples answered and not yet journaled (what a
        # SIGKILL could lose, besides the C in flight): a worker waits for both
        self._slots = asyncio.Semaphore(self.concurrency)
        self._unsettled = asyncio.Semaphore(2 * self.concurrency)
        self._finishing: set[asyncio.Task] = set()  # samples after their first request: decode, retries
        self._errors: list[BaseException] = []  # what ended a finishing sample (a journal failure, a bug)

    def timing(self) -> dict:
        """For the manifest (and the next run's `balanced` routing): the concurrency and the mean
        seconds per answered sample of this attempt (retries and their backoff included)."""
        return {
            "concurrency": self.concurrency,
            "answered": self.answered,
            "wall_s": round(time.monotonic() - self.started, 3),
            "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None,
        }

    def attempts_priced(self) -> dict:
        """For the manifest: how the attempts without an answer were priced, by OpenRouter's record
        of their generation or at the budget's estimate (an upper bound), and those an end-of-stage
        lookup priced again (their rows' provenance still says the estimate: the manifest's
        `spent_total_usd` and the summary's `cost_usd` hold the record's price)."""
        sources = [a.get("cost_source") for a in self.settled]
        return {
            "by_record": sources.count("generation_lookup"),
            "by_estimate": sources.count("estimate"),
            "repriced": self.repriced,
        }

    async def reprice_estimates(self) -> None:
        """Look up again the records of the attempts priced at the estimate (their generation named,
        its record not there after `cost_lookups` tries): OpenRouter's record usually lands seconds
        later. All of them each round, waiting `cost_lookup_delay_s`, then twice as long (at most
        5 s), until `record_wait_s` has passed; each one found replaces its estimate (journaled,
        in the budget and the stage's cost). One still missing stays at the estimate: never below."""
        todo = [a for a in self.settled if a.get("cost_source") == "estimate" and a.get("generation_id")]
        if not todo or self.o.record_wait_s <= 0:
            return
        client = SdkPost(self.base_url, self._key, self.concurrency, self.o.request_timeout_s, self.o.connect_timeout_s)
        deadline, delay = time.monotonic() + self.o.record_wait_s, max(self.o.cost_lookup_delay_s, 0.01)
        try:
            while todo:
                costs = await asyncio.gather(*(client.generation_cost(a["generation_id"], 1, 0.0) for a in todo))
                for a, cost in zip(todo, costs):
                    if cost is not None:
                        self._reprice(a, cost)
                todo = [a for a, cost in zip(todo, costs) if cost is None]
                left = deadline - time.monotonic()
                if not todo or left <= 0 or not client.records:
                    break
                await asyncio.sleep(min(delay, left))
                delay = min(2 * delay, 5.0)
        finally:
            await client.close()
        if todo:
            log.warning(
                "%s: %d attempts still have no record at /generation after %g s: counted at the estimate "
                "(an upper bound)",
                SOURCE,
                len(todo),
                self.o.record_wait_s,
            )

    def _reprice(self, attempt: dict, cost: float) -> None:
        estimate = attempt.get("cost_usd") or 0.0
        delta = self.stage.reprice_attempt(attempt, cost, earlier=attempt.get("attempt") in self._earlier)
        self.budget.add(delta)
        self.repriced.append(
            {
                "attempt": attempt.get("attempt"),
                "sample_id": attempt.get("sample_id"),
                "generation_id": attempt.get("generation_id"),
                "estimate_usd": round(estimate, 10),
                "cost_usd": cost,
            }
        )
        log.info(
            "%s: sample %s: the record of generation %s came: $%.6f instead of the estimate $%.6f",
            SOURCE,
            attempt.get("sample_id"),
            attempt.get("generation_id"),
            cost,
            estimate,
        )

    def _stop(self, reason: StopReason, detail: str | None) -> None:
        """Stop dispatching (the first reason wins): the workers send nothing more after their
        request in flight."""
        if self.stopped is None:
            self.stopped, self.stop_detail = reason, detail
            log.error("%s: stopping dispatch (%s)%s", SOURCE, reason, f": {detail}" if detail else "")

    def _tripped(self, error: str, run: int) -> None:
        self._stop(StopReason.REPEATED_ERROR, f"{run} requests in a row failed with: {error}")

    async def run(self) -> StopReason | None:
        """`concurrency` workers send; each sample's answer is decoded (and retried when it must
        be) by a task of its own, and one settler records. A worker hands its answer on, read but
        not decoded, and sends its next request at once. With a fixed latency the answers of all C
        requests come back in one burst, and if each worker first decoded the answer, or built,
        journaled and counted its row, the last worker's next request would leave only after all
        the others' (C x ~1 ms at C=256: 0.74-0.77 of C/L, benchmarks/overflow_client.py). Here the burst's
        requests leave together, and the decoding, the rows, the budget, the journal, the S3
        checkpoints and the next prompts' ids and bodies (`_prepare`) are done while they are out."""
        client = SdkPost(
            self.base_url,
            self._key,
            self.concurrency,
            self.o.request_timeout_s,
            self.o.connect_timeout_s,
            stream_idle_timeout_s=self.o.stream_idle_timeout_s,
        )
        try:
            if self.stage.pending_count or self.stage.unsettled_attempts:
                await client.check_reachable(self.o.unreachable_timeout_s)
                self.pin = await self._read_pin(client)
                self.rows = replace(self.rows, pin=self.pin)
                await self._price_unsettled(client)
        except BaseException:
            await client.close()
            raise
        self._prompts, self._ready = iter(self.stage.pending), deque()
        # a queue or semaphore is bound to the loop it first waits on: one of each per pass
        self._answers = asyncio.Queue()
        self._slots, self._unsettled = asyncio.Semaphore(self.concurrency), asyncio.Semaphore(2 * self.concurrency)
        self._finishing, self._errors = set(), []
        ticker = asyncio.create_task(tick_every(self.progress))
        settler = asyncio.create_task(self._settler())
        try:
            # a worker that fails stops the others after their request in flight, whose answer is paid
            outcomes = await asyncio.gather(
                *(self._worker(client) for _ in range(self.concurrency)), return_exceptions=True
            )
            while self._finishing:  # the samples still decoding or retrying after the last first request
                await asyncio.wait(set(self._finishing))
        finally:
            for task in self._finishing:  # cancelled (the run is): their samples stay pending
                task.cancel()
            if self._finishing:
                await asyncio.wait(set(self._finishing))
            if not settler.done():
                await self._answers.put(None)  # after every answer: the settler journals them all first
            try:
                await settler  # its error (a journal or S3 failure) is the run's
            finally:
                ticker.cancel()
                await client.close()
        for outcome in [*outcomes, *self._errors]:
            if isinstance(outcome, BaseException):
                raise outcome
        return self.stopped

    async def _read_pin(self, client: SdkPost) -> Pin:
        """The names an answer must carry (provider_identity): the pinned model's in the
        provider's model list and, when the routing restricts providers, the provider table. The
        list's prices for the model (OpenRouter's `pricing`) bound the budget's estimates."""
        listed = await client.get_json("models")
        cards = (listed or {}).get("data") or []
        self.budget.prices = self.budget.prices.at_least(listed_prices(self.model, cards))
        names = model_names(self.model, cards, self.base_url)
        allowed, ignored = allowed_providers(self.provider)
        slug_of: dict[str, str] = {}
        if allowed is not None or ignored:
            table = await client.get_json("providers")
            slug_of = provider_slugs((table or {}).get("data") or [])
            if not slug_of:
                raise UserError(
                    f"generation.overflow.provider pins providers ({', '.join(sorted(allowed or ignored))}) "
                    f"but GET {self.base_url.rstrip('/')}/providers lists none: answers could not be checked, "
                    "nothing was sent"
                )
        return Pin(self.model, names, allowed, ignored, slug_of)

    async def _price_unsettled(self, client: SdkPost) -> None:
        """Price the requests an earlier process opened and never settled (it died with them in
        flight), before their samples are asked again: all at once (each record lookup may wait
        for OpenRouter's record to appear; up to `concurrency` were in flight)."""
        await asyncio.gather(
            *(
                self._lose(
                    client,
                    a["sample_id"],
                    a.get("prompt_tokens") or 0,
                    a.get("attempt"),
                    a.get("generation_id"),
                    "in flight when an earlier attempt of the stage ended",
                )
                for a in self.stage.unsettled_attempts
            )
        )
        self.stage.unsettled_attempts.clear()

    async def _lose(
        self,
        client: SdkPost,
        sample_id: str,
        prompt_tokens: int,
        attempt: str | None,
        generation_id: str | None,
        why: str,
    ) -> None:
        """Count a request that may be billed without an answer: priced from OpenRouter's record of
        its generation, else at the budget's estimate for it (an upper bound), journaled settled
        and kept for the sample's row."""
        cost = None
        if generation_id is not None:
            cost = await client.generation_cost(generation_id, self.o.cost_lookups, self.o.cost_lookup_delay_s)
        source = "generation_lookup" if cost is not None else "estimate"
        if cost is None:
            cost = self.budget.estimate(prompt_tokens)
        record = {
            "attempt": attempt,
            "sample_id": sample_id,
            "generation_id": generation_id,
            "prompt_tokens": prompt_tokens,
            "state": "settled",
            "cost_usd": cost,
            "cost_source": source,
            "why": why,
        }
        self.stage.journal_attempt(record)
        self.budget.add(cost)
        self.progress.update(cost_usd=cost)
        self.lost.setdefault(sample_id, []).append(record)
        self.settled.append(record)
        log.warning("%s: sample %s: %s; counted $%.6f (%s)", SOURCE, sample_id, why, cost, source)

    def _prepare(self) -> bool:
        """Make the next pending prompt ready for its request (ids rendered, body encoded); False
        when none is left. A prompt the template refuses keeps its error: it becomes a permanent
        failed row, never a request."""
        p = next(self._prompts, None)
        if p is None:
            return False
        try:
            self._ready.append(
                _Ready(
                    p,
                    self.fmt.generation_prompt_ids(p.messages, p.tools, p.images),
                    json.dumps(self.shape.body(p)).encode(),
                    0.0,
                )
            )
        except Exception as exc:
            self._ready.append(_Ready(p, exc, b"", 0.0))
        return True

    def _take(self) -> _Ready | None:
        """A ready prompt; rendered now when the settler had no idle moment to do it ahead."""
        if not self._ready:
            self._prepare()
        return self._ready.popleft() if self._ready else None

    async def _worker(self, client) -> None:
        """Send each next prompt's first request, and hand an answer to a task of the sample's own
        (`_finish`) without decoding it: the next request leaves first. A refusal or a transport
        failure is judged here, before the next request, as it always was."""
        while self.stopped is None:
            await self._unsettled.acquire()
            ready = self._take() if self.stopped is None else None
            if ready is None:
                self._unsettled.release()
                return
            ids = ready.prompt_ids
            ready.estimate = self.budget.estimate(len(ids)) if isinstance(ids, list) else 0.0
            if not self.budget.allows(ready.estimate):
                self._ready.appendleft(ready)  # not sent: the next worker (or attempt) takes it
                self._unsettled.release()
                if self.in_flight == 0 or self.budget.spent + ready.estimate > (self.budget.max_usd or 0.0):
                    self._stop(
                        StopReason.BUDGET,
                        f"spent ${self.budget.spent:.4f} of max_usd {self.budget.max_usd}; the next "
                        f"request may cost up to ${ready.estimate:.4f}",
                    )
                    return
                await asyncio.sleep(0.05)  # wait for in-flight costs to settle
                continue
            self.budget.reserve(ready.estimate)
            self.in_flight += 1  # until its row is settled: the budget counts answers not yet priced
            started = time.monotonic()
            try:
                sent = await self._send(client, ready) if isinstance(ids, list) else None
            except BaseException:
                self._unsettle(ready)
                self._stop(StopReason.ERROR, None)  # the other workers stop sending
                raise
            finish = self._finish(client, ready, sent, started)
            if sent is not None and not isinstance(sent.outcome, Received):
                await finish  # a refusal or a transport failure is judged before the next request: a 402
                continue  # or a 401 stops dispatch, a 429 pauses it, a retry waits its backoff here
            task = asyncio.create_task(finish)
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, client, ready: _Ready, sent: _Sent | None, started: float) -> None:
        """The sample's answer decoded, its retries sent when it needs them, the outcome handed to
        the settler. It first lets the requests its burst sent meanwhile leave (aiohttp writes a
        request's body in a task of its own, queued behind this one on Python < 3.12)."""
        try:
            await asyncio.sleep(0)
            result = await self._sample(client, ready, sent)
        except asyncio.CancelledError:
            self._unsettle(ready)
            raise
        except BaseException as exc:
            self._unsettle(ready)
            self._errors.append(exc)
            self._stop(StopReason.ERROR, None)  # the workers stop sending
            return
        await self._answers.put((ready, result, time.monotonic() - started))

    def _unsettle(self, ready: _Ready) -> None:
        """A sample leaves dispatch (settled, or ended before the settler): its place among the
        unsettled and its budget reservation are freed."""
        self.in_flight -= 1
        self.budget.release(ready.estimate)
        self._unsettled.release()

    async def _settler(self) -> None:
        """Rows from answers, in arrival order: priced, journaled, counted, checkpointed. Yields
        after each answer, so answers arriving meanwhile send their next requests without waiting
        for the backlog. When no answer waits, it renders the next prompts ahead (`_prepare`, up
        to two bursts): the template render is ~40% of the client's CPU per request, and done
        on the send path it held back 0.05 of C/L (benchmarks/overflow_client.py). If a checkpoint fails
        (S3 down), the workers stop sending, the answers of the requests still out are journaled
        as they come (paid: a resume on this machine replays them), and the run ends with that error."""
        error: BaseException | None = None
        while True:
            # idle (no answer waiting): make one more prompt ready, then look again
            if self._answers.empty() and error is None and len(self._ready) < self._lookahead and self._prepare():
                await asyncio.sleep(0)
                continue
            if (item := await self._answers.get()) is None:
                break
            ready, result, latency_s = item
            self._unsettle(ready)
            if result is None:  # stopped (402/401/403...): the sample stays pending for the next attempt
                continue
            try:
                self._settle(ready, result, latency_s)  # local: the journal
                if error is None and self.stage.checkpoint_due():  # S3 uploads in a thread: the loop keeps sending
                    await asyncio.to_thread(self.stage.checkpoint)
            except Exception as exc:
                error = error or exc
                self._stop(StopReason.ERROR, None)
        if error is None:
            self._journal_failures(
                self.breaker.release()
            )  # fewer than K identical: those failures are the prompts' own
        if error is not None:
            raise error

    def _settle(self, ready: _Ready, result: _Answer | _Failed, latency_s: float) -> None:
        if isinstance(result, _Failed):
            if result.breaker is not None:
                if self.breaker.tripped is None:  # after a trip it stays pending, whatever else comes back
                    self._journal_failures(self.breaker.hold(result.breaker, result))
                return
            self._journal_failures(self.breaker.release())
            self._journal_failures([result])
            return
        self._journal_failures(self.breaker.release())
        p = ready.prompt
        if result.cost is None and self.budget.max_usd is not None:
            self._stop(
                StopReason.UNPRICED,
                f"sample {p.sample_id}: no usage.cost, no record at /generation and "
                "generation.overflow.price_usd_per_mtok is not set: the budget cannot bind (the answer is kept)",
            )
        row = answer_row(p, ready.prompt_ids, result.data, result.cost, result.cost_source, self.rows, result.lost)
        if row["status"] == "ok":
            self.latency_sum += latency_s
            self.answered += 1
        usage = row["usage"] or {}
        cost = usage.get("cost_usd") or 0.0
        self.budget.add(cost, {**(result.data.get("usage") or {}), "cost": cost})
        self.stage.journal(row, permanent=True, paid=True)  # paid: final whatever it is, never paid again
        ok = row["status"] == "ok"
        self.progress.update(ok=int(ok), failed=int(not ok), cost_usd=cost, tokens=usage.get("completion_tokens") or 0)

    def _journal_failures(self, failures: list[_Failed]) -> None:
        for f in failures:
            self.stage.journal(f.row, permanent=f.permanent)
            self.progress.update(failed=1)

    async def _send(self, client: SdkPost, ready: _Ready) -> _Sent | None:
        """One attempt's request, holding one of the `concurrency` request slots while it is on the
        wire; None when the stage stopped before it left."""
        import openai

        if self.stopped:
            return None
        if (wait := self.paused_until - time.monotonic()) > 0:
            await asyncio.sleep(wait)
            if self.stopped:
                return None
        p, attempt_id, named = ready.prompt, uuid.uuid4().hex[:16], []

        def opened(generation_id: str | None) -> None:
            named.append(generation_id)
            self.stage.journal_attempt(
                {
                    "attempt": attempt_id,
                    "sample_id": p.sample_id,
                    "state": "open",
                    "generation_id": generation_id,
                    "prompt_tokens": len(ready.prompt_ids),
                }
            )

        send = client.stream if self.o.stream else client.post
        async with self._slots:
            if self.stopped:
                return None
            try:
                outcome: Received | Exception = await send(ready.body, self._headers(p), opened)
            except (openai.APIStatusError, openai.APITimeoutError, openai.APIConnectionError, AttemptLost) as exc:
                outcome = exc
        return _Sent(attempt_id, bool(named), outcome)

    async def _sample(self, client: SdkPost, ready: _Ready, first: _Sent | None) -> _Answer | _Failed | None:
        """The decoded answer with its price, a failure after retries, or None when the stage
        stops (the sample stays pending: nothing is recorded for it). `first`: the first attempt,
        sent by the worker (None: it was not sent)."""
        import openai

        p, prompt_ids = ready.prompt, ready.prompt_ids
        if isinstance(prompt_ids, Exception):
            return _Failed(generation_row(p, None, SOURCE, failed=f"chat template: {prompt_ids}"), True)
        verdict = Verdict("retry", "no attempt")
        for attempt in range(1, self.max_attempts + 1):
            sent = first if attempt == 1 else await self._send(client, ready)
            if sent is None:
                return None
            attempt_id, named = sent.attempt_id, sent.named
            try:
                if isinstance(sent.outcome, Exception):
                    raise sent.outcome
                data = sent.outcome.answer()
            except openai.APIStatusError as exc:
                verdict = classify_status(exc.status_code, _json_or_none(exc.response), exc.response.headers)
            except openai.APITimeoutError as exc:
                verdict = Verdict("retry", f"transport: {type(exc).__name__}")
                if not self.o.stream:  # a non-streamed generation the client stopped waiting for is billed
                    await self._lose(
                        client, p.sample_id, len(prompt_ids), attempt_id, None, "timed out before the answer"
                    )
            except openai.APIConnectionError as exc:
                verdict = Verdict("retry", f"transport: {type(exc).__name__}")
            except AttemptLost as lost:
                await self._lose(client, p.sample_id, len(prompt_ids), attempt_id, lost.generation_id, lost.why)
                verdict = Verdict("retry", lost.why)
            else:
                if (verdict := body_error(data)) is not None and named:
                    gid = sent.outcome.generation_id or (data.get("id") if isinstance(data, dict) else None)
                    if isinstance(gid, str) and cost_unknown(data):  # may be billed: priced as a cut stream is
                        await self._lose(client, p.sample_id, len(prompt_ids), attempt_id, gid, verdict.reason)
                    else:  # its cost says nothing was billed, or no generation to look up
                        self.stage.journal_attempt({"attempt": attempt_id, "sample_id": p.sample_id, "state": "closed"})
                if verdict is None:
                    self.breaker.outcome(None)
                    cost, source = await priced(
                        client, data, self.configured_prices, self.o.cost_lookups, self.o.cost_lookup_delay_s
                    )
                    return _Answer(data, cost, source, self.lost.pop(p.sample_id, []))
            if verdict.action == "stop":
                self._stop(verdict.stop, verdict.reason)
                return None
            if verdict.action == "permanent":
                counted = None if verdict.prompt_specific else verdict.reason
                self.breaker.outcome(counted)
                return _Failed(self._failed(p, prompt_ids, verdict.reason), True, breaker=counted)
            if verdict.action == "pause":
                self.paused_until = max(self.paused_until, time.monotonic() + verdict.retry_after_s)
                log.warning("%s: %s; pausing dispatch %.0f s", SOURCE, verdict.reason, verdict.retry_after_s)
            if attempt < self.max_attempts:
                log.debug("sample %s attempt %d: %s; retrying", p.sample_id, attempt, verdict.reason)
                await asyncio.sleep(
                    backoff_s(
                        attempt, retry_after=None if verdict.retry_after_s is None else str(verdict.retry_after_s)
                    )
                )
        if verdict.stop in (
            StopReason.RATE_LIMITED,
            StopReason.IN_FLIGHT_BUDGET,
        ):  # the service's limits, not this prompt's fault
            self._stop(verdict.stop, f"{verdict.reason} (after {self.max_attempts} attempts)")
            return None
        self.breaker.outcome(None)
        return _Failed(
            self._failed(p, prompt_ids, f"gave up after {self.max_attempts} attempts: {verdict.reason}"), False
        )

    def _failed(self, p: Prompt, prompt_ids: list[int], reason: str) -> GenerationRow:
        """A failed row carrying the attempts its sample lost (paid money the row accounts for)."""
        return failed_with(generation_row(p, prompt_ids, SOURCE, failed=reason), self.lost.pop(p.sample_id, []))

    @staticmethod
    def _headers(p: Prompt) -> dict:
        """Dataset and sample id for the dev server's per-sample counters; providers ignore them."""
        return {"X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}


def _json_or_none(response) -> Any:
    try:
        return response.json()
    except Exception:
        return None
