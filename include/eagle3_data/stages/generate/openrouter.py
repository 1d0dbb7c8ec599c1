"""Overflow generation: OpenRouter chat completions (text only), bounded, budgeted, resumable.

The stage's parts, one unit each, so the next provider shape changes one place:
  openrouter_http      the wire: plain or streamed (SSE) requests, OpenRouter's tables;
  openrouter_rows      the request body (the history in OpenRouter's documented fields) and the row of an answer;
  openrouter_prompts   the pending prompts, rendered ahead of the send path;
  openrouter_send      one attempt on the wire, and a sample's attempts (retries, verdicts);
  openrouter_attempts  the journal of attempts: what may be paid without an answer is priced and counted;
  openrouter_settle    the rows: each result journaled, priced, counted;
  openrouter_pricing   an answer's cost and the per-token prices;
  openrouter_budget    the spend cap, from prices x tokens;
  openrouter_breaker   the circuit breaker for a config the provider refuses;
  openrouter_outcomes  what these parts hand each other;
  this module          the stage, and the run that composes the parts: workers send, one settler records.
Answers are text; `output_ids` stay null until the reconstruction stage. What is paid is never
lost (see checkpoint.py), and what may be paid is counted (openrouter_attempts); one priced at the
estimate is looked up again before the manifest is written (`record_wait_s`), as OpenRouter's
record often lands seconds late. The API key is passed in by the caller (the DAG reads the
Airflow connection) and only ever handed to the SDK: it is in no row, manifest, log line or
exception message produced here.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.config import OverflowGenerationConfig
from eagle3_data.errors import UserError
from eagle3_data.images import read_image
from eagle3_data.stages.generate.alarm import with_alarm_outside_callbacks
from eagle3_data.stages.generate.checkpoint import (
    StageRun,
    StageSetup,
    parse_prompts,
    reused_summary,
    run_rounds,
)
from eagle3_data.stages.generate.contracts import StageSummary, StopReason
from eagle3_data.stages.generate.openrouter_attempts import AttemptLedger
from eagle3_data.stages.generate.openrouter_breaker import Breaker
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_http import Received, SdkPost
from eagle3_data.stages.generate.openrouter_outcomes import (
    DispatchStop,
    Failed,
    Finished,
    Prepared,
    ReadyPrompt,
    Sent,
)
from eagle3_data.stages.generate.openrouter_pricing import Prices, listed_prices, price_answer
from eagle3_data.stages.generate.openrouter_prompts import PromptFeed
from eagle3_data.stages.generate.openrouter_rows import (
    REQUEST_FIELDS,
    SOURCE,
    RequestShape,
    RowContext,
    request_sampling,
)
from eagle3_data.stages.generate.openrouter_send import Sender
from eagle3_data.stages.generate.openrouter_settle import Settler
from eagle3_data.stages.generate.progress import Progress, ProgressSink, tick_every
from eagle3_data.stages.generate.provider_identity import (
    Pin,
    allowed_providers,
    model_names,
    provider_slugs,
)

if TYPE_CHECKING:
    from eagle3_data.storage.refs import StageRef
    from eagle3_data.storage.store import ArtifactStore

T = TypeVar("T")

ROUTES = ("overflow", "both")
__all__ = [
    "OverflowRuntime",
    "check_sampling",
    "generate_overflow",
    "price_answer",
    "request_sampling",
]


def check_sampling(sampling: Mapping[str, Any], *, where: str = "generation.sampling") -> dict[str, Any]:
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
class OverflowRuntime:
    """The client's own settings beside `generation.overflow` (no config sets them): retries,
    the first estimate, timings a test or benchmark tightens."""

    max_attempts: int = 6
    first_cost_estimate_usd: float = 0.01
    flush_interval_s: float = 30.0
    cost_lookups: int = 4  # GET /generation?id= tries for an answer without usage.cost (its record lags)
    cost_lookup_delay_s: float = 0.5  # the first wait; doubled after each 404
    capped: bool = True  # False: `max_usd` does not bind (a benchmark's or a test's run without a cap)


def generate_overflow(
    store: ArtifactStore,
    ref: StageRef,
    prompts: Iterable[dict[str, Any]],
    fmt: OutputFormat,
    base_url: str,
    api_key: str,
    sampling: Mapping[str, Any],
    *,
    config: OverflowGenerationConfig,
    reasoning: Mapping[str, Any] | None = None,
    runtime: OverflowRuntime = OverflowRuntime(),
    setup: StageSetup = StageSetup(),
) -> StageSummary:
    """Generate every pending prompt of `ref.dataset` (routes overflow|both) through OpenRouter;
    its summary.

    `fmt`: the output format bound to the generation mode (its prompt ids price the budget's
    estimate; `reasoning`, OpenRouter's `reasoning` object, follows its mode unless given).
    `sampling`: temperature, top_p, max_new_tokens, seed (`check_sampling`). `config`: the model,
    its provider routing, the budget and the client's bounds (`generation.overflow`).
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
    sampling = check_sampling(sampling)
    reasoning = dict(reasoning or {"enabled": fmt.thinking})
    params = {
        "source": SOURCE,
        "model": config.model,
        "provider": dict(config.provider),
        "sampling": dict(sampling, thinking=fmt.thinking),
        "reasoning": reasoning,
        "base_url": base_url,
    }
    rows = parse_prompts(prompts, ref.dataset, setup.routes if setup.routes is not None else ROUTES)
    progress = setup.progress or Progress()  # closed by run_rounds
    max_usd = config.max_usd if runtime.capped else None
    with StageRun(
        store,
        ref,
        rows,
        params,
        tokenizer_hashes(fmt.tokenizer),
        setup,
        rows_per_part=config.rows_per_part,
        flush_interval_s=runtime.flush_interval_s,
    ) as run:
        budget = Budget(
            max_usd,
            run.spent_before_usd,
            max_new_tokens=sampling.get("max_new_tokens"),
            prices=Prices.per_mtok(config.price_usd_per_mtok.model_dump()),
            first_estimate_usd=runtime.first_cost_estimate_usd,
        )
        client = OverflowRun(
            run,
            fmt,
            base_url,
            api_key,
            RequestShape(
                config.model,
                dict(config.provider),
                reasoning,
                sampling,
                config.stream,
                lambda image: read_image(run.store, image),
            ),
            config,
            runtime,
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
                "budget_usd": max_usd,
                "spent_total_usd": round(budget.spent, 6),
                "lost_attempts_priced": client.ledger.priced_summary(),
                "identity_pin": client.pin.to_json() if client.pin else None,
                **client.settler.timing(config.concurrency),
            },
            stop_detail=client.stop.detail,
        )
    assert run.result is not None  # `finish` sets it, also when it stops the stage
    return run.result


@contextmanager
def fewer_gc_pauses(threshold: tuple[int, int, int] = (50_000, 20, 1000)) -> Iterator[None]:
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


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run the client on uvloop (pinned in requirements.txt), else the stdlib loop: uvloop's
    C event loop takes ~0.1-0.3 ms less client CPU per request at C=256 (benchmarks/overflow_client.py).
    The loop takes SIGALRM meanwhile, so that an execution timeout is not lost in a callback (alarm.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(with_alarm_outside_callbacks(coro))
    return uvloop.run(with_alarm_outside_callbacks(coro))


class OverflowRun:
    """Dispatch: `concurrency` workers send (`Sender`), one settler records (`Settler`); the
    budget and the breaker gate what leaves, the ledger counts the attempts that may be paid."""

    def __init__(
        self,
        stage: StageRun,
        fmt: OutputFormat,
        base_url: str,
        api_key: str,
        shape: RequestShape,
        config: OverflowGenerationConfig,
        runtime: OverflowRuntime,
        progress: ProgressSink,
        budget: Budget,
    ):
        self.stage, self.base_url, self._api_key = stage, base_url, api_key
        self.config, self.progress, self.budget = config, progress, budget
        self.concurrency = config.concurrency
        self.stop = DispatchStop()
        self.breaker: Breaker[Failed] = Breaker(config.max_identical_errors, self._tripped)
        self.ledger = AttemptLedger(
            stage,
            budget,
            progress,
            cost_lookups=runtime.cost_lookups,
            cost_lookup_delay_s=runtime.cost_lookup_delay_s,
        )
        self.sender = Sender(
            stream=config.stream,
            concurrency=self.concurrency,
            max_attempts=runtime.max_attempts,
            prices=Prices.per_mtok(config.price_usd_per_mtok.model_dump()),
            cost_lookups=runtime.cost_lookups,
            cost_lookup_delay_s=runtime.cost_lookup_delay_s,
            stop=self.stop,
            ledger=self.ledger,
            breaker=self.breaker,
        )
        rows = RowContext(
            shape.model, dict(shape.provider), dict(shape.sampling), fmt.thinking, stage.tokenizer_sha256, None
        )
        self.settler = Settler(stage, budget, self.breaker, progress, self.stop, rows)
        self.feed = PromptFeed(fmt, shape, lookahead=2 * self.concurrency)  # a burst's worth, and the next
        self.pin: Pin | None = None
        # one pass's (`run`: once per round, each round on an event loop of its own)
        self._answers: asyncio.Queue[Finished | None] = asyncio.Queue()
        # at most C requests on the wire (`Sender`), and C more samples answered and not yet
        # journaled (what a SIGKILL could lose, besides the C in flight): a worker waits for both
        self._unsettled = asyncio.Semaphore(2 * self.concurrency)
        self._finishing: set[asyncio.Task[None]] = set()  # samples after their first request: decode, retries
        self._errors: list[BaseException] = []  # what ended a finishing sample (a journal failure, a bug)

    def _client(self, **stream_bounds: float) -> SdkPost:
        return SdkPost(
            self.base_url,
            self._api_key,
            self.concurrency,
            self.config.request_timeout_s,
            self.config.connect_timeout_s,
            **stream_bounds,
        )

    async def reprice_estimates(self) -> None:
        """The records of the attempts priced at the estimate, looked up again for up to
        `record_wait_s` (`AttemptLedger.reprice_estimates`)."""
        if not self.ledger.at_estimate() or self.config.record_wait_s <= 0:
            return
        client = self._client()
        try:
            await self.ledger.reprice_estimates(client, self.config.record_wait_s)
        finally:
            await client.close()

    def _tripped(self, error: str, run: int) -> None:
        self.stop.stop(StopReason.REPEATED_ERROR, f"{run} requests in a row failed with: {error}")

    async def run(self) -> StopReason | None:
        """`concurrency` workers send; each sample's answer is decoded (and retried when it must
        be) by a task of its own, and one settler records. A worker hands its answer on, read but
        not decoded, and sends its next request at once. With a fixed latency the answers of all C
        requests come back in one burst, and if each worker first decoded the answer, or built,
        journaled and counted its row, the last worker's next request would leave only after all
        the others' (C x ~1 ms at C=256: 0.74-0.77 of C/L, benchmarks/overflow_client.py). Here the burst's
        requests leave together, and the decoding, the rows, the budget, the journal, the S3
        checkpoints and the next prompts' ids and bodies (`PromptFeed.prepare`) are done while they are out."""
        client = self._client(stream_idle_timeout_s=self.config.stream_idle_timeout_s)
        try:
            if self.stage.pending_count or self.stage.unsettled_attempts:
                await client.check_reachable(self.config.unreachable_timeout_s)
                self.pin = await self._read_pin(client)
                self.settler.rows = replace(self.settler.rows, pin=self.pin)
                await self.ledger.price_unsettled(client)
        except BaseException:
            await client.close()
            raise
        self.feed.open(self.stage.pending)
        # a queue or semaphore is bound to the loop it first waits on: one of each per pass
        self._answers = asyncio.Queue()
        self._unsettled = asyncio.Semaphore(2 * self.concurrency)
        self.sender.open_pass()
        self._finishing, self._errors = set(), []
        ticker = asyncio.create_task(tick_every(self.progress))
        settler = asyncio.create_task(self._settle_answers())
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
        return self.stop.reason

    async def _read_pin(self, client: SdkPost) -> Pin:
        """The names an answer must carry (provider_identity): the pinned model's in the
        provider's model list and, when the routing restricts providers, the provider table. The
        list's prices for the model (OpenRouter's `pricing`) bound the budget's estimates."""
        model = self.config.model
        listed = await client.get_json("models")
        cards = (listed or {}).get("data") or []
        self.budget.prices = self.budget.prices.at_least(listed_prices(model, cards))
        names = model_names(model, cards, self.base_url)
        allowed, ignored = allowed_providers(dict(self.config.provider))
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
        return Pin(model, names, allowed, ignored, slug_of)

    def _admitted(self, prepared: Prepared) -> bool | None:
        """Whether the budget lets `prepared` leave now: True (its estimate reserved), False (wait
        for the samples in flight to be priced), None (the budget is spent: dispatch stops)."""
        if isinstance(prepared, ReadyPrompt):
            prepared.estimate = self.budget.estimate(len(prepared.prompt_ids))
        if self.budget.allows(prepared.estimate):
            self.budget.reserve(prepared.estimate)  # until its row is settled: answers not yet priced count
            return True
        self.feed.put_back(prepared)  # not sent: the next worker (or attempt) takes it
        self._unsettled.release()
        if self.budget.exhausted(prepared.estimate):
            self.stop.stop(
                StopReason.BUDGET,
                f"spent ${self.budget.spent:.4f} of max_usd {self.budget.max_usd}; the next "
                f"request may cost up to ${prepared.estimate:.4f}",
            )
            return None
        return False

    async def _worker(self, client: SdkPost) -> None:
        """Send each next prompt's first request, and hand an answer to a task of the sample's own
        (`_finish`) without decoding it: the next request leaves first. A refusal or a transport
        failure is judged here, before the next request, as it always was."""
        while not self.stop.stopped:
            await self._unsettled.acquire()
            prepared = self.feed.take() if not self.stop.stopped else None
            if prepared is None:
                self._unsettled.release()
                return
            admitted = self._admitted(prepared)
            if admitted is None:
                return
            if not admitted:
                await asyncio.sleep(0.05)  # wait for in-flight costs to settle
                continue
            started = time.monotonic()
            try:
                sent = await self.sender.send(client, prepared) if isinstance(prepared, ReadyPrompt) else None
            except BaseException:
                self._unsettle(prepared)
                self.stop.stop(StopReason.ERROR, None)  # the other workers stop sending
                raise
            finish = self._finish(client, prepared, sent, started)
            if sent is not None and not isinstance(sent.outcome, Received):
                await finish  # a refusal or a transport failure is judged before the next request: a 402
                continue  # or a 401 stops dispatch, a 429 pauses it, a retry waits its backoff here
            task = asyncio.create_task(finish)
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, client: SdkPost, prepared: Prepared, sent: Sent | None, started: float) -> None:
        """The sample's answer decoded, its retries sent when it needs them, the outcome handed to
        the settler. It first lets the requests its burst sent meanwhile leave (aiohttp writes a
        request's body in a task of its own, queued behind this one on Python < 3.12)."""
        try:
            await asyncio.sleep(0)
            result = await self.sender.sample(client, prepared, sent)
        except asyncio.CancelledError:
            self._unsettle(prepared)
            raise
        except BaseException as exc:
            self._unsettle(prepared)
            self._errors.append(exc)
            self.stop.stop(StopReason.ERROR, None)  # the workers stop sending
            return
        await self._answers.put(Finished(prepared, result, time.monotonic() - started))

    def _unsettle(self, prepared: Prepared) -> None:
        """A sample leaves dispatch (settled, or ended before the settler): its place among the
        unsettled and its budget reservation are freed."""
        self.budget.release(prepared.estimate)
        self._unsettled.release()

    async def _settle_answers(self) -> None:
        """Rows from answers, in arrival order: priced, journaled, counted, checkpointed
        (`Settler`). Yields after each answer, so answers arriving meanwhile send their next
        requests without waiting for the backlog. When no answer waits, it renders the next
        prompts ahead (`PromptFeed.prepare`). If a checkpoint fails (S3 down), the workers stop
        sending, the answers of the requests still out are journaled as they come (paid: a resume
        on this machine replays them), and the run ends with that error."""
        error: BaseException | None = None
        while True:
            # idle (no answer waiting): make one more prompt ready, then look again
            if self._answers.empty() and error is None and self.feed.wants_more() and self.feed.prepare():
                await asyncio.sleep(0)
                continue
            if (finished := await self._answers.get()) is None:
                break
            self._unsettle(finished.prepared)
            if finished.result is None:  # stopped (402/401/403...): the sample stays pending for the next attempt
                continue
            try:
                self.settler.settle(finished.prepared, finished.result, finished.latency_s)  # local: the journal
                if error is None and self.stage.checkpoint_due():  # S3 uploads in a thread: the loop keeps sending
                    await asyncio.to_thread(self.stage.checkpoint)
            except Exception as exc:
                error = error or exc
                self.stop.stop(StopReason.ERROR, None)
        if error is not None:
            raise error
        self.settler.release_held()  # fewer than K identical: those failures are the prompts' own
