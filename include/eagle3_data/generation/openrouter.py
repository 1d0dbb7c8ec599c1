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
    sampling_for,
)
from eagle3_data.generation.progress import Progress, tick_every
from eagle3_data.generation.retry import PERMANENT_STATUS, backoff_s

log = logging.getLogger(__name__)

SOURCE = "openrouter"
ROUTES = ("overflow", "both")
# The config's sampling keys (SGLang's names) -> OpenRouter chat-completion fields; the generation
# mode is not among them: it is bound into the output format (and sent as `reasoning`).
REQUEST_FIELDS = {"temperature": "temperature", "top_p": "top_p", "max_new_tokens": "max_tokens", "seed": "seed"}


def check_sampling(sampling: Mapping[str, Any], *, where: str = "generation.sampling") -> dict:
    """The sampling params this client sends; any other key is refused before a request (a key
    silently dropped would make the overflow share sample differently from the local one)."""
    for key in sampling:
        if key not in REQUEST_FIELDS:
            raise UserError(f"{where}: {key!r} is not a sampling parameter the OpenRouter client sends; "
                            f"accepted: {', '.join(REQUEST_FIELDS)}")
    return dict(sampling)
STOP_STATUS = {401: "unauthorized", 402: "credits"}
UNPRICED = "unpriced_answer"  # stopped_reason: an answer without usage.cost and no configured price


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
    stopped_reason: None (complete), "budget", "credits" (HTTP 402), "unauthorized" (401),
    "retryable_failures" (rerun to retry them), "unpriced_answer" (an answer came without
    `usage.cost` and `options.price_usd_per_mtok` is not set while a budget is: the budget could
    not bind, so nothing more is dispatched).
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
        progress.start(len(rows), len(rows) - run.pending_count, label=f"generate_overflow {ref.dataset}")
        budget = Budget(options.max_usd, run.spent_before_usd, options.first_cost_estimate_usd,
                        sampling.get("max_new_tokens"))
        client = _OverflowRun(run, fmt, base_url, api_key, replace(request, sampling=sampling, reasoning=reasoning),
                              options, progress, budget)
        try:
            with fewer_gc_pauses():
                stopped = run_event_loop(client.run())
        finally:
            progress.close()  # a bar left open would swallow the start of the error's line
        run.finish(stopped, extra={"budget_usd": options.max_usd, "spent_total_usd": round(client.budget.spent, 6),
                                   **client.timing()})
    return run.result


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
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()

    def timing(self) -> dict:
        """For the manifest (and the next run's `balanced` routing): the concurrency and the mean
        seconds per answered sample of this attempt (retries and their backoff included)."""
        return {"concurrency": self.concurrency, "answered": self.answered,
                "wall_s": round(time.monotonic() - self.started, 3),
                "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None}

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
                    self.stopped = self.stopped or "budget"
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
                self.stopped = self.stopped or "error"  # the other workers stop sending
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
            if result is None:  # stopped (402/401): the sample stays pending for the next attempt
                continue
            try:
                self._settle(p, prompt_ids, result, latency_s)  # local: the journal
                if error is None and self.stage.checkpoint_due():  # S3 uploads in a thread: the loop keeps sending
                    await asyncio.to_thread(self.stage.checkpoint)
            except Exception as exc:
                error, self.stopped = error or exc, self.stopped or "error"
            await asyncio.sleep(0)
        if error is not None:
            raise error

    def _settle(self, p: Prompt, prompt_ids, result, latency_s: float) -> None:
        # an answer is decoded JSON (a dict when well-formed); a failure is (row, permanent)
        row, permanent = result if isinstance(result, tuple) else self._row(p, prompt_ids, result)
        if row["status"] == "ok":
            self.latency_sum += latency_s
            self.answered += 1
        cost = (row.get("usage") or {}).get("cost_usd") or 0.0
        self.budget.add(cost, (row.get("usage") or {}).get("completion_tokens"))
        self.stage.journal(row, permanent=permanent)
        ok = row["status"] == "ok"
        self.progress.update(ok=int(ok), failed=int(not ok), cost_usd=cost,
                             tokens=(row.get("usage") or {}).get("completion_tokens") or 0)

    async def _sample(self, client, ready: _Ready) -> object:
        """The decoded answer, (failed row, permanent) after retries, or None when the stage must stop."""
        import openai

        p, prompt_ids = ready.prompt, ready.prompt_ids
        if isinstance(prompt_ids, Exception):
            return failed_row(p, None, SOURCE, f"chat template: {prompt_ids}"), True
        reason = "no attempt"
        for attempt in range(1, self.max_attempts + 1):
            if self.stopped:
                return None
            retry_after = None
            try:
                return await client.post(ready.body, self._headers(p))
            except openai.APIStatusError as exc:
                status = exc.status_code
                if status in STOP_STATUS:
                    if not self.stopped:
                        log.error("OpenRouter answered %d: stopping dispatch (%s)", status, STOP_STATUS[status])
                    self.stopped = self.stopped or STOP_STATUS[status]
                    return None
                reason = f"HTTP {status}: {_error_message(exc)}"
                if status in PERMANENT_STATUS:
                    return failed_row(p, prompt_ids, SOURCE, reason), True
                retry_after = exc.response.headers.get("retry-after")
            except (openai.APITimeoutError, openai.APIConnectionError) as exc:
                reason = f"transport: {type(exc).__name__}"
            except (openai.APIResponseValidationError, ValueError) as exc:
                return failed_row(p, prompt_ids, SOURCE, f"malformed answer: {type(exc).__name__}"), False
            if attempt < self.max_attempts:
                log.debug("sample %s attempt %d: %s; retrying", p.sample_id, attempt, reason)
                await asyncio.sleep(backoff_s(attempt, retry_after=retry_after))
        return failed_row(p, prompt_ids, SOURCE, f"gave up after {self.max_attempts} attempts: {reason}"), False

    def _request(self, p: Prompt) -> dict:
        s = sampling_for(p, self.sampling)
        body = {"model": self.model, "messages": p.messages, "reasoning": self.reasoning, "provider": self.provider,
                "usage": {"include": True}}
        if p.tools:
            body["tools"] = p.tools
        for ours, theirs in REQUEST_FIELDS.items():
            if s.get(ours) is not None:
                body[theirs] = s[ours]
        return body

    @staticmethod
    def _headers(p: Prompt) -> dict:
        """Dataset and sample id for the dev server's per-sample counters; providers ignore them."""
        return {"X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}

    def _row(self, p: Prompt, prompt_ids: list[int], resp) -> tuple[dict, bool]:
        data = resp if isinstance(resp, dict) else {}
        row = base_row(p, prompt_ids, SOURCE)
        choices = data.get("choices") or []
        usage = data.get("usage") or {}
        details = usage.get("completion_tokens_details") or {}
        cost = price_answer(usage, self.prices)
        if cost is None and self.budget.max_usd is not None:
            if not self.stopped:
                log.error("OpenRouter answered sample %s without usage.cost and generation.overflow.price_usd_per_mtok "
                          "is not set: the budget cannot bind, stopping dispatch (the answer is kept)", p.sample_id)
            self.stopped = self.stopped or UNPRICED
        row["usage"] = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                        "reasoning_tokens": details.get("reasoning_tokens"), "cost_usd": cost}
        row["provenance"] = json.dumps({
            "model": data.get("model") or self.model, "provider": data.get("provider"), "generation_id": data.get("id"),
            "requested_provider": self.provider, "sampling": sampling_for(p, self.sampling), "thinking": self.thinking,
            "tokenizer_sha256": self.tok_sha, "generated_at": time.time(),
            "cost_source": "openrouter" if usage.get("cost") is not None else ("configured_price" if cost is not None else None),
            **({"source_id": p.source_id} if p.source_id is not None else {}),
        }, sort_keys=True)
        if not choices:
            row.update(status="failed", error="malformed answer: no choices")
            return row, False
        choice = choices[0]
        msg = choice.get("message") or {}
        calls = [{"id": c.get("id"), "type": "function",
                  "function": {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}}
                 for c in msg.get("tool_calls") or []]
        finish = choice.get("finish_reason")
        row.update(reasoning=msg.get("reasoning"), content=msg.get("content"),
                   tool_calls=json.dumps(calls, ensure_ascii=False) if calls else None, finish_reason=finish)
        if finish not in ("stop", "length", "tool_calls"):
            row.update(status="failed", error=f"finish_reason {finish!r}")
        elif finish != "length" and not (msg.get("content") or "").strip() and not calls:
            row.update(status="failed", error="empty answer: no content and no tool calls")
        elif any(not c["function"]["name"] or not isinstance(c["function"]["arguments"], str) for c in calls):
            row.update(status="failed", error="malformed tool call: missing name or arguments")
        return row, False


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

    def _request(self):
        import httpx2

        return httpx2.Request("POST", self.url)  # what the SDK's exceptions carry; no key in it

    async def close(self) -> None:
        await self.http.close()
        await self.sdk.close()


def _error_message(exc) -> str:
    try:
        body = exc.response.json()
        return str((body.get("error") or {}).get("message") or body)[:200]
    except Exception:
        return str(exc.message)[:200]

