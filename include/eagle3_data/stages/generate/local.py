"""Local generation: exact output ids from the engines on the GPU nodes, data parallel across them.

One client for every engine; what differs per engine is its wire format, a `Wire` adapter
(`sglang.SGLANG`: `/generate`; `vllm.VLLM`: `/v1/completions` with token ids), so checkpoints,
journal, resume, retries, health and the record schema are the same whichever engine answers.

Each endpoint gets `in_flight` worker coroutines pulling from one shared queue, so a slot that
frees on any GPU node takes the next prompt at once (least-loaded dispatch without a scheduler)
and every endpoint stays `in_flight` deep. A transport failure puts the prompt back on the queue
for any endpoint while the failing worker backs off, so one sick node slows nothing else; a
full queue (SGLang's 503 "The request queue is full.") is backpressure: the prompt goes back and
the worker waits, but the endpoint is not counted as failing. Prompts go as ids rendered by the
tokenizer's chat template, never as text, so the prompt ids recorded are the ones the model saw;
an engine that ran other prompt ids than were sent (a server that truncates prompts) fails the row.

- `/health` answers 503 while a server warms up: endpoints are polled concurrently until ready or
  `warmup_timeout_s`; one that accepts no connection for `unreachable_timeout_s` is named dead at
  once. One is dropped after `max_endpoint_failures` consecutive failures and re-admitted when its
  `/health` answers again.
- Request ids are fresh per request (`{sample_id}.{run}.{attempt}`, `run` random per stage run):
  SGLang refuses a rid still registered, and notices a dropped client only every few seconds (a
  hung engine never lets it go), so a task retried after a kill must not reuse its killed rids.
- `stop_token_ids` is always sent, from the audited ids; the matched stop token stays in the ids
  the engine returns, recorded as given (the validator decides what a row's stop means).
- In flight per endpoint: `in_flight_per_endpoint` when set; else what the endpoint reports as its
  capacity (SGLang's `max_running_requests`), else DEFAULT_IN_FLIGHT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.config import LocalGenerationConfig, options_of
from eagle3_data.engines.client import (
    DEFAULT_IN_FLIGHT,
    MAX_IN_FLIGHT,
    MediaDiffers,
    PromptCut,
    Wire,
    error_message,
    health,
    read_media,
    server_capacity,
    wait_healthy,
)
from eagle3_data.errors import EndpointUnavailable, UserError
from eagle3_data.images import ImageError
from eagle3_data.json_records import fast_loads
from eagle3_data.retry import PERMANENT_STATUS, backoff_s
from eagle3_data.schemas import IDENTITY_MISMATCH
from eagle3_data.stages.generate.alarm import with_alarm_outside_callbacks
from eagle3_data.stages.generate.checkpoint import (
    Prompt,
    StageRun,
    StageSetup,
    generation_row,
    parse_prompts,
    reused_summary,
    run_rounds,
    sampling_for,
)
from eagle3_data.stages.generate.contracts import GenerationRow, StageSummary, StopReason
from eagle3_data.stages.generate.progress import Progress, ProgressSink, tick_every

log = logging.getLogger(__name__)

ROUTES = ("local", "both")


@dataclass(frozen=True)
@options_of(LocalGenerationConfig)
class LocalOptions:
    """How the local client runs: `generation.local` of the config (`config.options_from`), with
    timings a test or benchmark may tighten."""

    # generation.local: the defaults are the config's (config.options_of)
    in_flight_per_endpoint: int | None  # None: the endpoint's reported capacity
    rows_per_part: int
    warmup_timeout_s: float
    unreachable_timeout_s: float
    connect_timeout_s: float
    max_endpoint_failures: int
    served_model: str | None  # the name every endpoint must serve (GET /v1/models); None: recorded only
    # the client's own
    max_attempts: int = 5
    request_timeout_s: float = 3600.0
    health_interval_s: float = 2.0
    flush_interval_s: float = 30.0


def generate_local(
    store,
    ref,
    prompts: Iterable[dict],
    fmt: OutputFormat,
    endpoints: Sequence[str],
    sampling: Mapping[str, Any],
    *,
    wire: Wire,
    options: LocalOptions = LocalOptions(),
    setup: StageSetup = StageSetup(),
) -> StageSummary:
    """Generate every pending prompt of `ref.dataset` (routes local|both) on `wire`'s `endpoints`;
    its summary (stopped_reason `endpoints_lost` when every endpoint failed for a warm-up).

    `fmt`: the output format bound to the generation mode (renders the prompts, names the stop
    ids, parses the answers). `sampling`: the engine-neutral sampling params (temperature, top_p,
    max_new_tokens, ...), checked by the wire before any request. Resumes a killed attempt:
    committed sample_ids are skipped, journaled answers replayed. `setup.rerun` reopens a complete
    stage (parts re-verified, only missing or corrupt rows redone)."""
    from eagle3_data.tokenizer import tokenizer_hashes

    if store.is_complete(ref) and not setup.rerun:
        return reused_summary(store, ref)
    if not endpoints:
        raise UserError(f"generate_local: no {wire.engine} endpoints given")
    request = wire.sampling(sampling)
    request.setdefault("stop_token_ids", list(fmt.stop_token_ids))
    rows = parse_prompts(prompts, ref.dataset, setup.routes if setup.routes is not None else ROUTES)
    params = {"source": wire.source, "model": setup.model, "sampling": dict(request, thinking=fmt.thinking)}
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
        client = LocalRun(run, fmt, endpoints, request, wire, options, setup.model, progress)
        stopped = run_rounds(
            run,
            ref.dataset,
            lambda: asyncio.run(with_alarm_outside_callbacks(client.run())),
            progress,
            f"generate_local {ref.dataset} ({wire.engine})",
        )
        run.finish(
            stopped,
            extra={
                "endpoints": len(endpoints),
                "max_in_flight": client.max_in_flight,
                **client.timing(),
                **wire.manifest_extra(client.identity),
            },
            stop_detail=client.stop_detail,
        )
    return run.result


class LocalRun:
    """Shared queue + per-endpoint workers, health, drop/re-admit and retries for one stage."""

    def __init__(
        self,
        run: StageRun,
        fmt: OutputFormat,
        endpoints: Sequence[str],
        sampling: dict,
        wire: Wire,
        options: LocalOptions,
        model: str,
        progress: ProgressSink,
    ):
        self.stage, self.fmt, self.endpoints = run, fmt, [e.rstrip("/") for e in endpoints]
        self.sampling, self.wire, self.o = sampling, wire, options
        self.model, self.tok_sha, self.progress = model, run.tokenizer_sha256, progress
        self.run_tag = uuid.uuid4().hex[:8]
        self.busy = dict.fromkeys(self.endpoints, 0)
        self.max_in_flight = dict.fromkeys(self.endpoints, 0)
        self.failures = dict.fromkeys(self.endpoints, 0)  # consecutive, per endpoint
        self.identity: dict[str, dict] = {}
        self.capacity: dict[str, int] = {}  # workers per endpoint
        self.capacity_source: dict[str, str] = {}  # "config" | "server_info" | "default"
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()
        self.workers: dict[str, list[asyncio.Task]] = {}
        self.stop_reason: StopReason | None = None
        self.stop_detail: str | None = None  # what the stop was, in words
        self.feed_error: Exception | None = None
        # one pass's (`run`: once per round, each round on an event loop of its own)
        self.http: aiohttp.ClientSession | None = None
        # fresh prompts come from the stage's one-shot iterator as workers free up (only the
        # prompts in flight are decoded); the queue holds those handed back for another try
        self.feed: Iterator[Prompt] | None = None
        self.queue: asyncio.Queue[tuple[Prompt, int]] = asyncio.Queue()
        self.outstanding = 0  # pending samples not yet settled
        self.all_done = asyncio.Event()

    async def run(self) -> StopReason | None:
        # aiohttp, not httpx: httpx's connection pool costs several ms of CPU per request at this
        # depth and left the slots 60% empty against a fast server (benchmarks/sglang_client.py).
        # no pool limit: the workers bound the connections (per endpoint, known only after /server_info)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.o.request_timeout_s, sock_connect=self.o.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.wire.headers) as http:
            self.http = http
            log.info(
                "%s: waiting for %d endpoint(s) to answer /health: %s",
                self.wire.engine,
                len(self.endpoints),
                ", ".join(self.endpoints),
            )
            problems = await asyncio.gather(*(self._wait_ready(e) for e in self.endpoints))
            for e, problem in zip(self.endpoints, problems):
                if problem is not None:
                    log.warning("%s endpoint %s: %s; not used", self.wire.engine, e, problem)
            healthy = [e for e, problem in zip(self.endpoints, problems) if problem is None]
            if not healthy:
                raise EndpointUnavailable(
                    f"no {self.wire.engine} endpoint is usable: "
                    + "; ".join(f"{e}: {problem}" for e, problem in zip(self.endpoints, problems))
                    + ". Check the URLs (the local engine's connection, sglang_default, or --endpoint) and that the "
                    "servers run; a server still loading its model that does not listen yet: raise "
                    "generation.local.unreachable_timeout_s"
                )
            self.feed, self.outstanding = iter(self.stage.pending), self.stage.pending_count
            self.queue, self.all_done = asyncio.Queue(), asyncio.Event()  # bound to the loop they first wait on
            if not self.outstanding:
                return None
            for e in healthy:
                self._admit(e)
            watchers = [asyncio.create_task(tick_every(self.progress)), asyncio.create_task(self._readmit())]
            try:
                await self.all_done.wait()
            finally:
                tasks = watchers + [w for ws in self.workers.values() for w in ws]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if self.feed_error is not None:
                raise self.feed_error
        return self.stop_reason

    # -- endpoint health -------------------------------------------------------------------

    async def _wait_ready(self, endpoint: str) -> str | None:
        """`wait_healthy`, then what the endpoint serves and takes (`_ready`)."""
        problem = await wait_healthy(self.http, endpoint, self.wire.engine, self.o)
        return problem if problem is not None else await self._ready(endpoint)

    async def _ready(self, endpoint: str) -> str | None:
        """An endpoint just became healthy: what it serves (None, or why it is not used: another
        model than `served_model`), and how many requests it takes."""
        self.identity[endpoint] = identity = await self.wire.identify(self.http, endpoint)
        if self.o.served_model is not None and identity.get("served_model") != self.o.served_model:
            return (
                f"serves {identity.get('served_model')!r} (GET /v1/models), not generation.local.served_model "
                f"{self.o.served_model!r}"
            )
        await self._size(endpoint)
        return None

    async def _size(self, endpoint: str) -> None:
        """Workers for `endpoint`: the configured override, else its reported capacity, else the default."""
        if self.o.in_flight_per_endpoint is not None:
            self.capacity[endpoint], self.capacity_source[endpoint] = self.o.in_flight_per_endpoint, "config"
            return
        reported = await self._reported_capacity(endpoint)
        if reported is None:
            self.capacity[endpoint], self.capacity_source[endpoint] = DEFAULT_IN_FLIGHT, "default"
        else:
            self.capacity[endpoint], self.capacity_source[endpoint] = min(reported, MAX_IN_FLIGHT), "server_info"
        log.info(
            "%s endpoint %s: %d in flight (%s)",
            self.wire.engine,
            endpoint,
            self.capacity[endpoint],
            "its max_running_requests"
            if reported is not None
            else "default: it reports no capacity; set generation.local.in_flight_per_endpoint",
        )

    async def _reported_capacity(self, endpoint: str) -> int | None:
        for path in self.wire.capacity_paths:
            try:
                async with self.http.get(f"{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                    if r.status != 200:
                        continue
                    info = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            return server_capacity(info)
        return None

    def timing(self) -> dict:
        """For the manifest (and the next run's `balanced` routing): in flight per endpoint, where
        that came from, and the mean seconds per answered request of this attempt."""
        return {
            "in_flight": dict(self.capacity),
            "in_flight_source": dict(self.capacity_source),
            "answered": self.answered,
            "wall_s": round(time.monotonic() - self.started, 3),
            "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None,
        }

    def _admit(self, endpoint: str) -> None:
        self.failures[endpoint] = 0
        n = self.capacity.get(endpoint, self.o.in_flight_per_endpoint or DEFAULT_IN_FLIGHT)
        self.workers[endpoint] = [asyncio.create_task(self._worker(endpoint)) for _ in range(n)]

    def _drop(self, endpoint: str) -> None:
        """After `max_endpoint_failures` consecutive failures: its workers stop (their prompts go
        back on the queue) and `_readmit` watches its /health."""
        if endpoint not in self.workers:
            return
        log.warning(
            "%s endpoint %s: %d consecutive failures; dropped until /health answers again",
            self.wire.engine,
            endpoint,
            self.failures[endpoint],
        )
        current = asyncio.current_task()
        for t in self.workers.pop(endpoint):
            if t is not current:
                t.cancel()

    async def _readmit(self) -> None:
        """Re-admit dropped endpoints that come back; stop the stage when none is left for a warm-up."""
        alone_since = None
        while True:
            await asyncio.sleep(self.o.health_interval_s)
            for e in [e for e in self.endpoints if e not in self.workers]:
                if await health(self.http, e, self.o.connect_timeout_s) == 200:
                    if (problem := await self._ready(e)) is not None:
                        log.warning("%s endpoint %s: healthy again but %s; not used", self.wire.engine, e, problem)
                        continue
                    log.info("%s endpoint %s: healthy again; re-admitted", self.wire.engine, e)
                    self._admit(e)
            if self.workers:
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > self.o.warmup_timeout_s:
                self.stop_reason = StopReason.ENDPOINTS_LOST
                self.stop_detail = (
                    f"every {self.wire.engine} endpoint failed and none came back within {self.o.warmup_timeout_s:g} s"
                )
                self.all_done.set()
                return

    # -- requests --------------------------------------------------------------------------

    async def _take(self) -> tuple[Prompt, int]:
        """The next fresh prompt, then (once none is left) those put back: the order of one FIFO
        queue holding every pending prompt, without decoding them all up front."""
        if self.feed is not None:
            try:
                p = next(self.feed, None)
            except Exception as exc:  # the local spill is unreadable: stop the stage, do not hang it
                self.feed_error, self.feed = exc, None
                self.all_done.set()
                raise
            if p is not None:
                return p, 0
            self.feed = None
        return await self.queue.get()

    async def _worker(self, endpoint: str) -> None:
        full = 0  # consecutive "queue full" answers of this worker's endpoint
        while True:
            p, attempts = await self._take()
            self.busy[endpoint] += 1
            self.max_in_flight[endpoint] = max(self.max_in_flight[endpoint], self.busy[endpoint])
            started = time.monotonic()
            try:
                outcome = await self._one(endpoint, p, attempts)
            except asyncio.CancelledError:
                self.queue.put_nowait((p, attempts))  # its endpoint was dropped: another one takes it
                raise
            finally:
                self.busy[endpoint] -= 1
            if outcome.backpressure:  # the engine is full: the same attempt again later, the endpoint is fine
                full += 1
                self.queue.put_nowait((p, attempts))
                await asyncio.sleep(backoff_s(min(full, 8)))
                continue
            full = 0
            row = outcome.row
            if row["status"] == "ok":
                self.latency_sum += time.monotonic() - started
                self.answered += 1
            self.failures[endpoint] = self.failures[endpoint] + 1 if outcome.endpoint_failed else 0
            if row["status"] == "failed" and not outcome.permanent and attempts + 1 < self.o.max_attempts:
                self.queue.put_nowait((p, attempts + 1))  # any endpoint may take it
                if self.failures[endpoint] >= self.o.max_endpoint_failures:
                    self._drop(endpoint)
                    return
                await asyncio.sleep(backoff_s(attempts + 1))
                continue
            self._settle(row, permanent=outcome.permanent)

    def _settle(self, row: GenerationRow, permanent: bool) -> None:
        self.stage.record(row, permanent=permanent and row["status"] != "ok")
        ok = row["status"] == "ok"
        self.progress.update(
            ok=int(ok), failed=int(not ok), tokens=(row.get("usage") or {}).get("completion_tokens") or 0
        )
        self.outstanding -= 1
        if self.outstanding == 0:
            self.all_done.set()

    async def _one(self, endpoint: str, p: Prompt, attempt: int) -> Outcome:
        """One request: an ok row, or a failed row and whether it is final (no attempt can fix it);
        transport errors and 5xx count against the endpoint, a full queue against nothing."""
        source = self.wire.source
        refs = p.images
        try:
            prompt_ids = self.fmt.generation_prompt_ids(p.messages, p.tools, refs)
        except Exception as exc:  # the template refuses this conversation: permanent
            return Outcome(generation_row(p, None, source, failed=f"chat template: {exc}"), permanent=True)
        media = None
        if refs:
            try:
                # S3 reads and decoding: off the event loop
                media = await asyncio.to_thread(read_media, self.stage.store, refs, self.fmt.media_pad_id)
            except ImageError as exc:  # the stored object is gone or not the one the prompt recorded
                return Outcome(generation_row(p, prompt_ids, source, failed=f"images: {exc}"), permanent=True)
        row = generation_row(p, prompt_ids, source)
        sampling = sampling_for(p, self.sampling)
        rid = f"{p.sample_id}.{self.run_tag}.{attempt}"  # fresh per request: SGLang refuses a rid still registered
        identity = self.identity.get(endpoint, {})
        path, body = self.wire.request(prompt_ids, sampling, rid, identity, media)
        headers = {"X-Request-Id": rid, "X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}
        started = time.monotonic()
        try:
            async with self.http.post(f"{endpoint}{path}", json=body, headers=headers) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            reason = f"transport: {type(exc).__name__} from {endpoint}"
            return Outcome(generation_row(p, prompt_ids, source, failed=reason), endpoint_failed=True)
        if status != 200:
            if self.wire.backpressure(status, text):
                return Outcome(row, backpressure=True)
            reason = f"HTTP {status} from {endpoint}: {error_message(text)[:300]}"
            return Outcome(
                generation_row(p, prompt_ids, source, failed=reason),
                permanent=status in PERMANENT_STATUS,
                endpoint_failed=status >= 500 or status in (401, 403),
            )
        try:
            ids, finish, engine_provenance, logprobs = self.wire.answer(fast_loads(text), prompt_ids, identity, media)
        except PromptCut as exc:  # every attempt on this server cuts it the same way
            return Outcome(
                generation_row(p, prompt_ids, source, failed=f"prompt cut by {endpoint}: {exc}"), permanent=True
            )
        except MediaDiffers as exc:  # its processor counts the same way on every attempt
            return Outcome(
                generation_row(p, prompt_ids, source, failed=f"media tokens: {endpoint} {exc}"), permanent=True
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return Outcome(generation_row(p, prompt_ids, source, failed=f"malformed answer from {endpoint}: {exc}"))
        if finish["type"] not in ("stop", "length"):
            return Outcome(generation_row(p, prompt_ids, source, failed=f"finish_reason {finish!r} from {endpoint}"))
        named = engine_provenance.get("served_model")
        if self.o.served_model is not None and named is not None and named != self.o.served_model:
            row = generation_row(
                p,
                prompt_ids,
                source,
                failed=f"identity: model: answered by {named!r}, pinned "
                f"{self.o.served_model!r} (generation.local.served_model) at {endpoint}",
            )
            row.update(status=IDENTITY_MISMATCH, provenance=json.dumps({"served_model": named, "endpoint": endpoint}))
            return Outcome(row, permanent=True)
        msg = self.fmt.parse_ids(ids, finish["type"]).message
        end = self.fmt.reasoning_end_id
        reasoning_tokens = (ids.index(end) if end in ids else len(ids)) if self.fmt.thinking and end is not None else 0
        row.update(
            output_ids=ids,
            output_logprobs=logprobs,
            reasoning=msg.reasoning,
            content=msg.content,
            tool_calls=json.dumps([c.to_openai() for c in msg.tool_calls], ensure_ascii=False)
            if msg.tool_calls
            else None,
            finish_reason=finish["type"],
            usage={
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "reasoning_tokens": reasoning_tokens,
                "cost_usd": None,
            },
            provenance=json.dumps(
                {
                    "model": self.model,
                    "engine": source,
                    "endpoint": endpoint,
                    "sampling": sampling,
                    "thinking": self.fmt.thinking,
                    "tokenizer_sha256": self.tok_sha,
                    "rid": rid,
                    "e2e_latency": round(time.monotonic() - started, 4),
                    "finish_reason": finish,
                    "generated_at": time.time(),
                    "logprobs": self.wire.logprob_distribution(sampling),
                    **engine_provenance,
                    **_source(p),
                },
                sort_keys=True,
            ),
        )
        return Outcome(row)


class Outcome(NamedTuple):
    """One request's result for the worker loop."""

    row: GenerationRow
    permanent: bool = False  # a failed row no attempt can fix
    endpoint_failed: bool = False  # counts toward dropping the endpoint
    backpressure: bool = False  # the engine is full: the same attempt again later


def _source(p: Prompt) -> dict:
    """The prompt row's own id, when it had one (provenance beside the sample id)."""
    return {"source_id": p.source_id} if p.source_id is not None else {}
