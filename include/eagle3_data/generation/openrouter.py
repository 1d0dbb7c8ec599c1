"""Overflow generation: OpenRouter chat completions (text only), bounded, budgeted, resumable.

The SDK's own retries are off (`max_retries=0`): one retry loop here sees every attempt, so
backoff honours `Retry-After`, counts toward one limit and shows in the logs. Answers are text;
`output_ids` stay null until the reconstruction stage. What is paid is never lost (see
checkpoint.py); the budget stops dispatching once spent + in-flight estimate would pass it.
The API key is passed in by the caller (the DAG reads the Airflow connection) and only ever
handed to the SDK: it is in no row, manifest, log line or exception message produced here.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

from eagle3_data import json_records
from eagle3_data.errors import EndpointUnavailable, UserError
from eagle3_data.generation.checkpoint import (
    Prompt,
    StageRun,
    StageSetup,
    base_row,
    failed_row,
    parse_prompts,
    reused_summary,
    run_rounds,
    sampling_for,
)
from eagle3_data.generation.progress import Progress, tick_every
from eagle3_data.generation.provider_answers import (
    IN_FLIGHT_BUDGET,
    RATE_LIMITED,
    REPEATED_ERROR,
    Verdict,
    body_error,
    classify_status,
    describe,
    error_of,
    read_message,
)
from eagle3_data.generation.provider_identity import (
    Pin,
    allowed_providers,
    model_names,
    provider_slugs,
)
from eagle3_data.generation.retry import backoff_s
from eagle3_data.schemas import IDENTITY_MISMATCH

log = logging.getLogger(__name__)

SOURCE = "openrouter"
ROUTES = ("overflow", "both")
# The config's sampling keys (SGLang's names) -> OpenRouter chat-completion fields; the generation
# mode is not among them: it is bound into the output format (and sent as `reasoning`).
REQUEST_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens", "seed": "seed",
                  "sampling_seed": "seed"}


def check_sampling(sampling: Mapping[str, Any], *, where: str = "generation.sampling") -> dict:
    """The sampling params this client sends; any other key is refused before a request (a key
    silently dropped would make the overflow share sample differently from the local one)."""
    for key in sampling:
        if key not in REQUEST_FIELDS:
            raise UserError(f"{where}: {key!r} is not a sampling parameter the OpenRouter client sends; "
                            f"accepted: {', '.join(REQUEST_FIELDS)}")
    return dict(sampling)


def request_sampling(sampling: Mapping[str, Any]) -> dict:
    """OpenRouter's fields for the config's sampling params. `top_k` -1 (SGLang's "whole
    vocabulary") is OpenRouter's 0 ("disabled")."""
    out = {REQUEST_FIELDS[k]: v for k, v in sampling.items() if v is not None}
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


UNPRICED = "unpriced_answer"  # stopped_reason: an answer without a cost anywhere while a budget binds


def price_answer(usage: dict, price_usd_per_mtok: dict | None) -> float | None:
    """USD of one answer: OpenRouter's `usage.cost`, else the configured per-token prices times
    the reported tokens; None when neither is known (the budget could not bind)."""
    if usage.get("cost") is not None:
        return float(usage["cost"])
    prices = price_usd_per_mtok or {}
    if not (prices.get("prompt") or prices.get("completion")):
        return None
    if usage.get("prompt_tokens") is None or usage.get("completion_tokens") is None:
        return None
    return (usage["prompt_tokens"] * (prices.get("prompt") or 0.0)
            + usage["completion_tokens"] * (prices.get("completion") or 0.0)) / 1e6


class Budget:
    """Stop dispatching when spent + in-flight x (estimated cost of one request) would pass the cap.

    The estimate is an upper bound learned from answers: the largest USD per completion token seen
    times `max_new_tokens` (every request may run to the limit), or the largest cost seen when the
    limit is unknown; `first_estimate_usd` until the first priced answer.
    """

    def __init__(self, max_usd: float | None, spent_usd: float = 0.0, first_estimate_usd: float = 0.01,
                 max_new_tokens: int | None = None):
        self.max_usd, self.spent, self.estimate = max_usd, spent_usd, first_estimate_usd
        self.max_new_tokens = max_new_tokens
        self.seen = False

    def allows(self, in_flight: int) -> bool:
        return self.max_usd is None or self.spent + (in_flight + 1) * self.estimate <= self.max_usd

    def add(self, cost: float, completion_tokens: int | None = None) -> None:
        self.spent += cost
        if cost <= 0:  # a failure without an answer says nothing about the price of an answer
            return
        bound = cost / max(completion_tokens or 1, 1) * self.max_new_tokens if self.max_new_tokens and completion_tokens else cost
        self.estimate = max(self.estimate, bound) if self.seen else bound
        self.seen = True


@dataclass(frozen=True)
class OverflowRequest:
    """What every sample of the stage asks the provider for: part of the stage's params."""

    model: str  # OpenRouter model slug
    provider: Mapping[str, Any] = field(default_factory=dict)  # routing: order, allow_fallbacks, quantizations, ...
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, top_p, max_new_tokens, seed
    reasoning: Mapping[str, Any] | None = None  # OpenRouter's `reasoning` object; None: {"enabled": thinking}


@dataclass(frozen=True)
class OverflowOptions:
    """How the overflow client runs: `generation.overflow` of the config (`from_config`), with
    timings a test or benchmark may tighten."""

    concurrency: int = 256
    rows_per_part: int = 64
    max_usd: float | None = None  # stop dispatching before spent + in flight would pass it
    price_usd_per_mtok: Mapping[str, float] | None = None  # prices answers that carry no usage.cost
    max_attempts: int = 6
    request_timeout_s: float = 600.0
    first_cost_estimate_usd: float = 0.01
    flush_interval_s: float = 30.0
    unreachable_timeout_s: float = 15.0
    connect_timeout_s: float = 5.0
    max_identical_errors: int = 10  # this many identical permanent errors in a row stop dispatch
    cost_lookups: int = 4  # GET /generation?id= tries for an answer without usage.cost (its record lags)
    cost_lookup_delay_s: float = 0.5  # the first wait; doubled after each 404

    @classmethod
    def from_config(cls, overflow: Any, **overrides: Any) -> OverflowOptions:
        """The options an `OverflowGenerationConfig` sets (same field names), plus `overrides`."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in overflow.model_dump().items() if k in names}, **overrides})


def generate_overflow(store, ref, prompts: Iterable[dict], fmt, base_url: str, api_key: str, request: OverflowRequest,
                      *, options: OverflowOptions = OverflowOptions(), setup: StageSetup = StageSetup()) -> dict:
    """Generate every pending prompt of `ref.dataset` (routes overflow|both) through OpenRouter;
    summary dict.

    `fmt`: the output format bound to the generation mode (its prompt ids price the budget's
    estimate; `reasoning` follows its mode unless the request sets it).
    stopped_reason (with `stop_detail`, the provider's words, when it answered): None (complete);
    "budget"; "credits" (402 out of credits), "unauthorized" (401), "forbidden" (403: a key limit,
    a workspace budget), "repeated_error" (`max_identical_errors` identical permanent errors in a
    row: a config the provider refuses), "unpriced_answer" (no cost in the answer, none at
    /generation and no configured price, while a budget binds): a person must act; and
    "rate_limited", "in_flight_budget" (429s, or 402s for the in-flight budget, past every retry),
    "retryable_failures": they pass, the next attempt resumes.
    `setup.rerun` regenerates a complete stage: answers still in the local journal are replayed
    first (never paid twice), the rest is requested again.
    """
    from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256

    if store.is_complete(ref) and not setup.rerun:
        return reused_summary(store, ref)
    if not api_key:
        raise UserError("generate_overflow: no API key (set the openrouter connection's password or OPENROUTER_API_KEY)")
    sampling = check_sampling(request.sampling)
    reasoning = dict(request.reasoning or {"enabled": fmt.thinking})
    params = {"source": SOURCE, "model": request.model, "provider": dict(request.provider),
              "sampling": dict(sampling, thinking=fmt.thinking), "reasoning": reasoning, "base_url": base_url}
    rows = parse_prompts(prompts, ref.dataset, setup.routes if setup.routes is not None else ROUTES)
    progress = setup.progress or Progress()
    hashes = {"tokenizer_sha256": tokenizer_files_sha256(fmt.tokenizer), "template_sha256": chat_template_sha256(fmt.tokenizer)}
    with StageRun(store, ref, rows, params, hashes, setup, rows_per_part=options.rows_per_part,
                  flush_interval_s=options.flush_interval_s) as run:
        budget = Budget(options.max_usd, run.spent_before_usd, options.first_cost_estimate_usd,
                        sampling.get("max_new_tokens"))
        client = _OverflowRun(run, fmt, base_url, api_key, replace(request, sampling=sampling, reasoning=reasoning),
                              options, progress, budget)
        try:
            with fewer_gc_pauses():
                stopped = run_rounds(run, ref.dataset, lambda: run_event_loop(client.run()), progress,
                                     f"generate_overflow {ref.dataset}")
        finally:
            progress.close()  # a bar left open would swallow the start of the error's line
        run.finish(stopped, extra={"budget_usd": options.max_usd, "spent_total_usd": round(client.budget.spent, 6),
                                   "identity_pin": client.pin.to_json() if client.pin else None, **client.timing()})
    return {**run.result, "stop_detail": client.stop_detail}


@contextmanager
def fewer_gc_pauses(threshold: tuple[int, int, int] = (50_000, 20, 1000)):
    """Rarer garbage collections while the client runs. With the default thresholds (700, 10, 10)
    the answers' JSON made a young collection every few answers and a full one (every tracked
    object of the process: tokenizer, template, SDK, pydantic models) every ~second, each a
    pause of 20-400 ms in which no answer was read and no request sent: 1.8-3.5 s of a 9 s run
    at C=256 (benchmarks/RESULTS.md). Objects alive before the run are frozen out of the
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
    C event loop takes ~0.1-0.3 ms less client CPU per request at C=256 (benchmarks/RESULTS.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@dataclass(slots=True)
class _Ready:
    """A pending prompt made ready off the send path: its ids (or the template's refusal) and
    its request body, encoded."""

    prompt: Prompt
    prompt_ids: list[int] | Exception
    body: bytes


@dataclass(slots=True)
class _Answer:
    """A decoded answer body and its price: USD and where it came from (None: not known)."""

    data: dict
    cost: float | None
    cost_source: str | None


@dataclass(slots=True)
class _Failed:
    """A failed sample's row. `permanent`: final now (the same request fails again); `breaker`:
    the error text the circuit breaker compares (None: it does not count)."""

    row: dict
    permanent: bool
    breaker: str | None = None


class _OverflowRun:
    def __init__(self, run: StageRun, fmt, base_url: str, api_key: str, request: OverflowRequest,
                 options: OverflowOptions, progress: Progress, budget: Budget):
        self.stage, self.fmt, self.base_url, self._key = run, fmt, base_url, api_key
        self.model, self.provider, self.thinking = request.model, dict(request.provider), fmt.thinking
        self.sampling, self.reasoning = dict(request.sampling), dict(request.reasoning)
        self.o, self.concurrency, self.max_attempts = options, options.concurrency, options.max_attempts
        self.progress, self.tok_sha, self.budget = progress, run.tokenizer_sha256, budget
        self.prices = options.price_usd_per_mtok
        self.in_flight = 0
        self.stopped: str | None = None
        self.stop_detail: str | None = None  # the provider's words for the stop
        self.pin: Pin | None = None
        self.paused_until = 0.0  # monotonic: no request leaves before (a 402 in-flight budget, a 429 hint)
        self._repeats: list[_Failed] = []  # the identical permanent failures in a row, not yet journaled
        self._identical: tuple[str | None, int] = (None, 0)  # the last outcome's error and its run, as they come
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()

    def timing(self) -> dict:
        """For the manifest (and the next run's `balanced` routing): the concurrency and the mean
        seconds per answered sample of this attempt (retries and their backoff included)."""
        return {"concurrency": self.concurrency, "answered": self.answered,
                "wall_s": round(time.monotonic() - self.started, 3),
                "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None}

    def _stop(self, reason: str, detail: str | None) -> None:
        """Stop dispatching (the first reason wins): the workers send nothing more after their
        request in flight."""
        if self.stopped is None:
            self.stopped, self.stop_detail = reason, detail
            log.error("%s: stopping dispatch (%s)%s", SOURCE, reason, f": {detail}" if detail else "")

    async def run(self) -> str | None:
        """`concurrency` workers send; one settler records. A worker hands its answer to the settler
        and sends its next request at once. With a fixed latency the answers of all C requests come
        back in one burst, and if each worker first built, journaled and counted its row, the last
        worker's next request would leave only after all the others' rows (C x ~1 ms at C=256):
        the achieved rate was 0.74-0.77 of C/L (benchmarks/RESULTS.md). Here the burst's requests
        leave together (the settler takes one answer per pass of the event loop), and the rows, the
        budget, the journal, the S3 checkpoints and the next prompts' ids and bodies (`_prepare`)
        are done while they are out."""
        client = SdkPost(self.base_url, self._key, self.concurrency, self.o.request_timeout_s, self.o.connect_timeout_s)
        try:
            if self.stage.pending_count:
                await client.check_reachable(self.o.unreachable_timeout_s)
                self.pin = await self._read_pin(client)
        except BaseException:
            await client.close()
            raise
        self._prompts = iter(self.stage.pending)
        # prompts made ready ahead (the settler does it when idle): a burst's worth, and the next
        self._ready: deque[_Ready] = deque()
        self._lookahead = 2 * self.concurrency
        # bounded: a worker waits when the settler is C answers behind, so at most C answers are
        # received and not yet journaled (what a SIGKILL could lose, besides the C in flight)
        self._answers: asyncio.Queue = asyncio.Queue(maxsize=self.concurrency)
        ticker = asyncio.create_task(tick_every(self.progress))
        settler = asyncio.create_task(self._settler())
        try:
            # a worker that fails stops the others after their request in flight, whose answer is paid
            outcomes = await asyncio.gather(*(self._worker(client) for _ in range(self.concurrency)),
                                            return_exceptions=True)
        finally:
            if not settler.done():
                await self._answers.put(None)  # after every answer: the settler journals them all first
            try:
                await settler  # its error (a journal or S3 failure) is the run's
            finally:
                ticker.cancel()
                await client.close()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return self.stopped

    async def _read_pin(self, client: SdkPost) -> Pin:
        """The names an answer must carry (provider_identity): the pinned model's in the
        provider's model list and, when the routing restricts providers, the provider table."""
        listed = await client.get_json("models")
        names = model_names(self.model, (listed or {}).get("data") or [], self.base_url)
        allowed, ignored = allowed_providers(self.provider)
        slug_of: dict[str, str] = {}
        if allowed is not None or ignored:
            table = await client.get_json("providers")
            slug_of = provider_slugs((table or {}).get("data") or [])
            if not slug_of:
                raise UserError(f"generation.overflow.provider pins providers ({', '.join(sorted(allowed or ignored))}) "
                                f"but GET {self.base_url.rstrip('/')}/providers lists none: answers could not be checked, "
                                "nothing was sent")
        return Pin(self.model, names, allowed, ignored, slug_of)

    def _prepare(self) -> bool:
        """Make the next pending prompt ready for its request (ids rendered, body encoded); False
        when none is left. A prompt the template refuses keeps its error: it becomes a permanent
        failed row, never a request."""
        p = next(self._prompts, None)
        if p is None:
            return False
        try:
            self._ready.append(_Ready(p, self.fmt.generation_prompt_ids(p.messages, p.tools),
                                      json.dumps(self._request(p)).encode()))
        except Exception as exc:
            self._ready.append(_Ready(p, exc, b""))
        return True

    def _take(self) -> _Ready | None:
        """A ready prompt; rendered now when the settler had no idle moment to do it ahead."""
        if not self._ready:
            self._prepare()
        return self._ready.popleft() if self._ready else None

    async def _worker(self, client) -> None:
        while self.stopped is None:
            if not self.budget.allows(self.in_flight):
                if self.in_flight == 0 or not self.budget.allows(0):
                    self._stop("budget", f"spent ${self.budget.spent:.4f} of max_usd {self.budget.max_usd}")
                    return
                await asyncio.sleep(0.05)  # wait for in-flight costs to settle the estimate
                continue
            ready = self._take()
            if ready is None:
                return
            self.in_flight += 1  # until its row is settled: the budget counts answers not yet priced
            started = time.monotonic()
            try:
                result = await self._sample(client, ready)
            except BaseException:
                self.in_flight -= 1
                self._stop("error", None)  # the other workers stop sending
                raise
            await self._answers.put((ready.prompt, ready.prompt_ids, result, time.monotonic() - started))

    async def _settler(self) -> None:
        """Rows from answers, in arrival order: priced, journaled, counted, checkpointed. Yields
        after each answer, so answers arriving meanwhile send their next requests without waiting
        for the backlog. When no answer waits, it renders the next prompts ahead (`_prepare`, up
        to two bursts): the template render is ~40% of the client's CPU per request, and done
        on the send path it held back 0.05 of C/L (benchmarks/RESULTS.md). If a checkpoint fails (S3 down), the workers stop sending, the answers of the requests
        still out are journaled as they come (paid: a resume on this machine replays them), and
        the run ends with that error."""
        error: BaseException | None = None
        while True:
            # idle (no answer waiting): make one more prompt ready, then look again
            if self._answers.empty() and error is None and len(self._ready) < self._lookahead and self._prepare():
                await asyncio.sleep(0)
                continue
            if (item := await self._answers.get()) is None:
                break
            p, prompt_ids, result, latency_s = item
            self.in_flight -= 1
            if result is None:  # stopped (402/401/403...): the sample stays pending for the next attempt
                continue
            try:
                self._settle(p, prompt_ids, result, latency_s)  # local: the journal
                if error is None and self.stage.checkpoint_due():  # S3 uploads in a thread: the loop keeps sending
                    await asyncio.to_thread(self.stage.checkpoint)
            except Exception as exc:
                error = error or exc
                self._stop("error", None)
            await asyncio.sleep(0)
        if error is None and self.stopped != REPEATED_ERROR:
            self._release_repeats()  # fewer than K identical: those failures are the prompts' own
        if error is not None:
            raise error

    def _settle(self, p: Prompt, prompt_ids, result: _Answer | _Failed, latency_s: float) -> None:
        if isinstance(result, _Failed):
            if self._breaker(result):
                return
            row, permanent, paid = result.row, result.permanent, False
        else:
            self._release_repeats()
            row, paid = self._row(p, prompt_ids, result), True
            permanent = row["status"] != "ok"  # paid: final whatever it is, never paid again
        if row["status"] == "ok":
            self.latency_sum += latency_s
            self.answered += 1
        usage = row.get("usage") or {}
        cost = usage.get("cost_usd") or 0.0
        self.budget.add(cost, usage.get("completion_tokens"))
        self.stage.journal(row, permanent=permanent, paid=paid)
        ok = row["status"] == "ok"
        self.progress.update(ok=int(ok), failed=int(not ok), cost_usd=cost, tokens=usage.get("completion_tokens") or 0)

    def _count(self, error: str | None) -> None:
        """The circuit breaker's count, as outcomes come back (before the settler has them, so it
        trips after at most `concurrency - 1` more requests): `max_identical_errors` identical
        permanent errors in a row stop dispatch with that error. `error` None: another outcome."""
        last, run = self._identical
        run = run + 1 if error is not None and error == last else int(error is not None)
        self._identical = (error, run)
        if run >= self.o.max_identical_errors:
            self._stop(REPEATED_ERROR, f"{run} requests in a row failed with: {error}")

    def _breaker(self, failed: _Failed) -> bool:
        """Identical permanent failures in a row are held back (True: this one is held): if the
        breaker trips they stay pending (the error is the config's or the account's, not the
        prompts': a rerun after the fix generates them); a different outcome releases them as
        the prompts' own."""
        if failed.breaker is None or (self._repeats and self._repeats[0].breaker != failed.breaker):
            self._release_repeats()
            if failed.breaker is None:
                return False
        self._repeats.append(failed)
        return True

    def _release_repeats(self) -> None:
        held, self._repeats = self._repeats, []
        for f in held:
            self.stage.journal(f.row, permanent=f.permanent)
            self.progress.update(failed=1)

    async def _sample(self, client, ready: _Ready) -> _Answer | _Failed | None:
        """The decoded answer with its price, a failure after retries, or None when the stage
        stops (the sample stays pending: nothing is recorded for it)."""
        import openai

        p, prompt_ids = ready.prompt, ready.prompt_ids
        if isinstance(prompt_ids, Exception):
            return _Failed(failed_row(p, None, SOURCE, f"chat template: {prompt_ids}"), True)
        verdict = Verdict("retry", "no attempt")
        for attempt in range(1, self.max_attempts + 1):
            if self.stopped:
                return None
            if (wait := self.paused_until - time.monotonic()) > 0:
                await asyncio.sleep(wait)
                if self.stopped:
                    return None
            try:
                data = await client.post(ready.body, self._headers(p))
            except openai.APIStatusError as exc:
                verdict = classify_status(exc.status_code, _json_or_none(exc.response), exc.response.headers)
            except (openai.APITimeoutError, openai.APIConnectionError) as exc:
                verdict = Verdict("retry", f"transport: {type(exc).__name__}")
            except (openai.APIResponseValidationError, ValueError) as exc:
                # unreadable: whether it was billed is unknown, so the budget counts it at the
                # estimate of one answer (in this attempt; a rerun cannot know it)
                self.budget.add(self.budget.estimate)
                verdict = Verdict("retry", f"malformed answer: {type(exc).__name__}")
            else:
                if (verdict := body_error(data)) is None:
                    self._count(None)
                    return await self._priced(client, data)
            if verdict.action == "stop":
                self._stop(verdict.stop, verdict.reason)
                return None
            if verdict.action == "permanent":
                self._count(verdict.reason)
                return _Failed(failed_row(p, prompt_ids, SOURCE, verdict.reason), True, breaker=verdict.reason)
            if verdict.action == "pause":
                self.paused_until = max(self.paused_until, time.monotonic() + verdict.retry_after_s)
                log.warning("%s: %s; pausing dispatch %.0f s", SOURCE, verdict.reason, verdict.retry_after_s)
            if attempt < self.max_attempts:
                log.debug("sample %s attempt %d: %s; retrying", p.sample_id, attempt, verdict.reason)
                await asyncio.sleep(backoff_s(attempt, retry_after=None if verdict.retry_after_s is None
                                              else str(verdict.retry_after_s)))
        if verdict.stop in (RATE_LIMITED, IN_FLIGHT_BUDGET):  # the service's limits, not this prompt's fault
            self._stop(verdict.stop, f"{verdict.reason} (after {self.max_attempts} attempts)")
            return None
        self._count(None)
        return _Failed(failed_row(p, prompt_ids, SOURCE, f"gave up after {self.max_attempts} attempts: {verdict.reason}"),
                       False)

    async def _priced(self, client, data: dict) -> _Answer:
        """The answer with its price: `usage.cost`, else OpenRouter's record of the generation
        (`GET /generation?id=`, retried while it is not there yet), else the configured prices."""
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        if usage.get("cost") is not None:
            return _Answer(data, float(usage["cost"]), "openrouter")
        if isinstance(data.get("id"), str) and (cost := await client.generation_cost(
                data["id"], self.o.cost_lookups, self.o.cost_lookup_delay_s)) is not None:
            return _Answer(data, cost, "generation_lookup")
        cost = price_answer(usage, self.prices)
        return _Answer(data, cost, "configured_price" if cost is not None else None)

    def _request(self, p: Prompt) -> dict:
        body = {"model": self.model, "messages": p.messages, "reasoning": self.reasoning, "provider": self.provider,
                "usage": {"include": True}}
        if p.tools:
            body["tools"] = p.tools
        body.update(request_sampling(sampling_for(p, self.sampling)))
        return body

    @staticmethod
    def _headers(p: Prompt) -> dict:
        """Dataset and sample id for the dev server's per-sample counters; providers ignore them."""
        return {"X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}

    def _row(self, p: Prompt, prompt_ids: list[int], answer: _Answer) -> dict:
        """The row of a paid answer: ok, or why it cannot be used (final either way)."""
        data, cost = answer.data, answer.cost
        row = base_row(p, prompt_ids, SOURCE)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        details = usage.get("completion_tokens_details") or {}
        if cost is None and self.budget.max_usd is not None:
            self._stop(UNPRICED, f"sample {p.sample_id}: no usage.cost, no record at /generation and "
                       "generation.overflow.price_usd_per_mtok is not set: the budget cannot bind (the answer is kept)")
        row["usage"] = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                        "reasoning_tokens": details.get("reasoning_tokens"), "cost_usd": cost}
        choices = data.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        text = read_message(choice.get("message") or {}) if choice else None
        provenance = {
            "model": data.get("model") or self.model, "provider": data.get("provider"), "generation_id": data.get("id"),
            "requested_provider": self.provider, "sampling": sampling_for(p, self.sampling), "thinking": self.thinking,
            "tokenizer_sha256": self.tok_sha, "generated_at": time.time(), "cost_source": answer.cost_source,
            **({"source_id": p.source_id} if p.source_id is not None else {}),
            **({"rewritten": list(text.rewritten)} if text and text.rewritten else {}),
        }
        row["provenance"] = json.dumps(provenance, sort_keys=True)
        if not choice:
            row.update(status="failed", error="malformed answer: no choices")
            return row
        finish = choice.get("finish_reason")
        row.update(reasoning=text.reasoning, content=text.content, finish_reason=finish,
                   tool_calls=json.dumps(text.tool_calls, ensure_ascii=False) if text.tool_calls else None)
        if self.pin is not None and (why := self.pin.mismatch(data.get("model"), data.get("provider"))):
            row.update(status=IDENTITY_MISMATCH, error=f"identity: {why}")
        elif finish == "error" or choice.get("error"):
            row.update(status="failed", error=f"{describe(error_of(choice) or {'message': 'finish_reason error'})} "
                                             "(mid-generation; the partial answer was billed)")
        elif finish not in ("stop", "length", "tool_calls"):
            row.update(status="failed", error=f"finish_reason {finish!r}")
        elif text.problem:
            row.update(status="failed", error=text.problem)
        elif text.unreconstructable:
            row.update(status="unreconstructable", error=f"unreconstructable: {text.unreconstructable}")
        elif finish != "length" and not (text.content or "").strip() and not text.tool_calls:
            row.update(status="failed", error="empty answer: no content and no tool calls")
        return row


def _json_or_none(response) -> Any:
    try:
        return response.json()
    except Exception:
        return None


class SdkPost:
    """POST /chat/completions as the openai SDK would send it, at a quarter of its CPU.

    The SDK builds the client: base URL normalisation, the `Authorization` header from the key
    (`auth_headers`) and its default headers (User-Agent, X-Stainless-*), and the error classes:
    a non-2xx answer becomes the SDK's own exception (`RateLimitError`, `AuthenticationError`,
    `InternalServerError`, ... via its `_make_status_error_from_response`, `.response.headers`
    carrying Retry-After), a transport failure `APIConnectionError`/`APITimeoutError`. What is
    left out is the SDK's per-request pipeline (option models copied twice, httpx2 URL and header
    objects, redirects/auth hooks, the vendored transport adapting aiohttp to httpx2): 2.3-3.2 ms
    CPU per request against 0.6-0.7 ms for this send over the same aiohttp; the whole stage went
    from 2.6-3.5 to 1.0-1.7 ms per request, one core from ~300 to 600-960 requests/s
    (benchmarks/RESULTS.md). The SDK's own retries are off anyway (our loop in `_sample` sees
    every attempt), a static API key needs none of its token-refresh hooks, and OpenRouter does
    not redirect (a 3xx is raised like any other non-2xx status).
    """

    def __init__(self, base_url: str, api_key: str, concurrency: int, timeout_s: float, connect_timeout_s: float = 5.0):
        import aiohttp
        from openai import AsyncOpenAI

        self.sdk = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.url = str(self.sdk.base_url) + "chat/completions"  # the SDK keeps a trailing slash
        self.headers = {k: v for k, v in {**self.sdk.default_headers, **self.sdk.auth_headers}.items()
                        if isinstance(v, str)}
        self.connect_timeout_s = connect_timeout_s
        self.records = True  # whether GET /generation?id= serves OpenRouter's generation records
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency + 8, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s))

    async def check_reachable(self, within_s: float) -> None:
        """Before the first paid request: `GET {base}/models` gets an HTTP answer at all (any
        status: the host is up and speaks HTTP), else EndpointUnavailable naming the URL and what
        was tried, after `within_s` of refused or timed-out connections (never a silent wait
        through every sample's retries)."""
        import aiohttp

        url = str(self.sdk.base_url) + "models"
        started, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                async with self.http.get(url, headers=self.headers, timeout=aiohttp.ClientTimeout(
                        total=30.0, sock_connect=self.connect_timeout_s)) as r:
                    await r.read()
                    return
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                last = f"{type(exc).__name__}: {str(exc)[:160]}"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return  # it accepted the connection: the requests' own retries take it from here
            waited = time.monotonic() - started
            if waited >= within_s:
                raise EndpointUnavailable(
                    f"{SOURCE} base URL {self.sdk.base_url}: no connection for {waited:.0f} s ({tries} tries of GET "
                    f"{url}, last: {last}): nothing was sent. Check the openrouter_default connection's host (or "
                    "--base-url) and the network")
            log.info("%s base URL %s: no connection yet (%s); trying again", SOURCE, self.sdk.base_url, last)
            await asyncio.sleep(min(float(tries), 3.0, max(0.0, within_s - waited)))

    async def post(self, body: dict | bytes, headers: dict) -> object:
        """The decoded JSON answer; raises the SDK's exception classes (a non-JSON 2xx body: ValueError).
        `body`: the request, or its JSON already encoded."""
        import aiohttp
        import openai

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            async with self.http.post(self.url, data=data, headers={**self.headers, **headers}) as r:
                content = await r.read()
                status, raw_headers = r.status, r.raw_headers
        except asyncio.TimeoutError as exc:
            raise openai.APITimeoutError(request=self._request()) from exc
        except aiohttp.ClientError as exc:
            raise openai.APIConnectionError(request=self._request()) from exc
        if status >= 300:
            import httpx2

            response = httpx2.Response(status, headers=raw_headers, content=content, request=self._request())
            raise self.sdk._make_status_error_from_response(response)
        return json_records.loads(content)  # a cut surrogate pair in the text is a malformed answer

    async def get_json(self, path: str, params: dict | None = None) -> Any:
        """`GET {base}/{path}`'s decoded JSON, None when it answers an error status or no JSON
        (an OpenAI-compatible server without OpenRouter's tables); transport errors propagate."""
        status, body = await self._get(path, params)
        return body if status < 300 else None

    async def _get(self, path: str, params: dict | None = None) -> tuple[int, Any]:
        import aiohttp

        url = str(self.sdk.base_url) + path
        try:
            async with self.http.get(url, params=params, headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=30.0, sock_connect=self.connect_timeout_s)) as r:
                status, content = r.status, await r.read()
        except asyncio.TimeoutError:
            return 504, None
        try:
            return status, json_records.loads(content)
        except ValueError:
            return status, None

    async def generation_cost(self, generation_id: str, tries: int, delay_s: float) -> float | None:
        """`total_cost` of OpenRouter's record of a generation (`GET /generation?id=`), which
        often answers 404 for a moment after the completion: retried `tries` times, waiting
        `delay_s`, then twice as long. None when it never gives a number. A base URL whose 404
        is not OpenRouter's error body has no such records (vLLM, SGLang): not asked again."""
        import aiohttp

        for attempt in range(tries if self.records else 0):
            try:
                status, record = await self._get("generation", {"id": generation_id})
            except aiohttp.ClientError:
                status, record = 0, None
            if status == 404 and not (isinstance(record, dict) and isinstance(record.get("error"), dict)):
                self.records = False
                log.info("%sgeneration is not OpenRouter's generation record: answers without usage.cost are priced "
                         "from generation.overflow.price_usd_per_mtok", self.sdk.base_url)
                return None
            cost = ((record or {}).get("data") or {}).get("total_cost") if isinstance(record, dict) else None
            if isinstance(cost, (int, float)) and not isinstance(cost, bool):
                return float(cost)
            if attempt + 1 < tries:
                await asyncio.sleep(delay_s * 2 ** attempt)
        return None

    def _request(self):
        import httpx2

        return httpx2.Request("POST", self.url)  # what the SDK's exceptions carry; no key in it

    async def close(self) -> None:
        await self.http.close()
        await self.sdk.close()
