"""Local generation: exact output ids from the engines on the GPU nodes, data parallel across them.

One client for every engine; what differs per engine is its wire format, a `Wire` adapter
(`sglang.SGLANG`: `/generate`; `vllm.VLLM`: `/v1/completions` with token ids), so checkpoints,
journal, resume, retries, health and the record schema are the same whichever engine answers.

Each endpoint gets `in_flight` worker coroutines pulling from one shared queue
(`local_dispatch`), so a slot that frees on any GPU node takes the next prompt at once
(least-loaded dispatch without a scheduler) and every endpoint stays `in_flight` deep. A
transport failure puts the prompt back on the queue for any endpoint while the failing worker
backs off, so one sick node slows nothing else; a full queue (SGLang's 503 "The request queue is
full.") is backpressure: the prompt goes back and the worker waits, but the endpoint is not
counted as failing. The parts: `local_endpoints` (health, capacity, drop and re-admit),
`local_request` (one request and its row), `local_dispatch` (the pending prompts), this module
(the stage, and the workers that compose them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.config import LocalGenerationConfig
from eagle3_data.engines.client import Wire
from eagle3_data.errors import UserError
from eagle3_data.retry import backoff_s
from eagle3_data.stages.generate.alarm import with_alarm_outside_callbacks
from eagle3_data.stages.generate.checkpoint import (
    StageRun,
    StageSetup,
    parse_prompts,
    reused_summary,
    run_rounds,
)
from eagle3_data.stages.generate.contracts import GenerationRow, StageSummary, StopReason
from eagle3_data.stages.generate.local_dispatch import Attempt, PendingPrompts
from eagle3_data.stages.generate.local_endpoints import EndpointPool, HealthWait
from eagle3_data.stages.generate.local_request import LocalRequester
from eagle3_data.stages.generate.progress import Progress, ProgressSink, tick_every

if TYPE_CHECKING:
    from eagle3_data.storage.refs import StageRef
    from eagle3_data.storage.store import ArtifactStore

ROUTES = ("local", "both")


@dataclass(frozen=True)
class LocalRuntime:
    """The client's own settings beside `generation.local` (no config sets them): retries and
    timings a test or benchmark tightens."""

    max_attempts: int = 5
    request_timeout_s: float = 3600.0
    health_interval_s: float = 2.0
    flush_interval_s: float = 30.0


def generate_local(
    store: ArtifactStore,
    ref: StageRef,
    prompts: Iterable[dict[str, Any]],
    fmt: OutputFormat,
    endpoints: Sequence[str],
    sampling: Mapping[str, Any],
    *,
    wire: Wire,
    config: LocalGenerationConfig = LocalGenerationConfig(),
    runtime: LocalRuntime = LocalRuntime(),
    setup: StageSetup = StageSetup(),
) -> StageSummary:
    """Generate every pending prompt of `ref.dataset` (routes local|both) on `wire`'s `endpoints`;
    its summary (stopped_reason `endpoints_lost` when every endpoint failed for a warm-up).

    `fmt`: the output format bound to the generation mode (renders the prompts, names the stop
    ids, parses the answers). `sampling`: the engine-neutral sampling params (temperature, top_p,
    max_new_tokens, ...), checked by the wire before any request. `config`: `generation.local`.
    Resumes a killed attempt: committed sample_ids are skipped, journaled answers replayed.
    `setup.rerun` reopens a complete stage (parts re-verified, only missing or corrupt rows redone)."""
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
        rows_per_part=config.rows_per_part,
        flush_interval_s=runtime.flush_interval_s,
    ) as run:
        pool = EndpointPool(endpoints, wire, config, HealthWait(config, runtime.health_interval_s))
        requester = LocalRequester(
            store,
            fmt,
            wire,
            request,
            model=setup.model,
            served_model=config.served_model,
            tokenizer_sha256=run.tokenizer_sha256,
        )
        client = LocalRun(run, pool, requester, runtime, progress)
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
                "max_in_flight": pool.max_in_flight,
                **client.timing(),
                **wire.manifest_extra(pool.identity),
            },
            stop_detail=client.stop_detail,
        )
    assert run.result is not None  # `finish` sets it, also when it stops the stage
    return run.result


class LocalRun:
    """Shared queue + per-endpoint workers for one stage: the endpoints' health, drop and re-admit
    (`EndpointPool`), the requests (`LocalRequester`), the pending prompts (`PendingPrompts`)."""

    def __init__(
        self,
        stage: StageRun,
        pool: EndpointPool,
        requester: LocalRequester,
        runtime: LocalRuntime,
        progress: ProgressSink,
    ):
        self.stage, self.pool, self.requester, self.runtime, self.progress = stage, pool, requester, runtime, progress
        self.pending = PendingPrompts()
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()
        self.stop_reason: StopReason | None = None
        self.stop_detail: str | None = None  # what the stop was, in words
        self.http: aiohttp.ClientSession | None = None  # one pass's (`run`: each round on an event loop of its own)

    @property
    def _session(self) -> aiohttp.ClientSession:
        """The pass's session (set while `run` runs)."""
        assert self.http is not None, "used outside `run`"
        return self.http

    async def run(self) -> StopReason | None:
        # aiohttp, not httpx: httpx's connection pool costs several ms of CPU per request at this
        # depth and left the slots 60% empty against a fast server (benchmarks/sglang_client.py).
        # no pool limit: the workers bound the connections (per endpoint, known only after /server_info)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(
            total=self.runtime.request_timeout_s, sock_connect=self.pool.config.connect_timeout_s
        )
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.pool.wire.headers) as http:
            self.http = http
            healthy = await self.pool.usable(http)
            self.pending.open(self.stage.pending, self.stage.pending_count)
            if not self.pending.outstanding:
                return None
            for endpoint in healthy:
                self.pool.admit(endpoint, self._start_worker)
            watchers = [asyncio.create_task(tick_every(self.progress)), asyncio.create_task(self._watch_endpoints())]
            try:
                await self.pending.done.wait()
            finally:
                tasks = watchers + self.pool.workers_running()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if self.pending.error is not None:
                raise self.pending.error
        return self.stop_reason

    async def _watch_endpoints(self) -> None:
        """Re-admit the endpoints that come back; stop the stage when none is left for a warm-up."""
        self.stop_detail = await self.pool.readmit(self._start_worker)
        self.stop_reason = StopReason.ENDPOINTS_LOST
        self.pending.done.set()

    def timing(self) -> dict[str, Any]:
        """For the manifest (and the next run's `balanced` routing): in flight per endpoint, where
        that came from, and the mean seconds per answered request of this attempt."""
        return {
            **self.pool.timing(),
            "answered": self.answered,
            "wall_s": round(time.monotonic() - self.started, 3),
            "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None,
        }

    def _start_worker(self, endpoint: str) -> asyncio.Task[None]:
        return asyncio.create_task(self._worker(endpoint))

    async def _worker(self, endpoint: str) -> None:
        pool = self.pool
        full = 0  # consecutive "queue full" answers of this worker's endpoint
        while True:
            attempt = await self.pending.take()
            pool.busy[endpoint] += 1
            pool.max_in_flight[endpoint] = max(pool.max_in_flight[endpoint], pool.busy[endpoint])
            started = time.monotonic()
            try:
                outcome = await self.requester.send(
                    self._session, endpoint, pool.identity.get(endpoint, {}), attempt.prompt, attempt.failed
                )
            except asyncio.CancelledError:
                self.pending.put_back(attempt)  # its endpoint was dropped: another one takes it
                raise
            finally:
                pool.busy[endpoint] -= 1
            if outcome.backpressure:  # the engine is full: the same attempt again later, the endpoint is fine
                full += 1
                self.pending.put_back(attempt)
                await asyncio.sleep(backoff_s(min(full, 8)))
                continue
            full = 0
            row = outcome.row
            if row["status"] == "ok":
                self.latency_sum += time.monotonic() - started
                self.answered += 1
            too_many_failures = pool.count(endpoint, failed=outcome.endpoint_failed)
            retry = attempt.failed + 1
            if row["status"] == "failed" and not outcome.permanent and retry < self.runtime.max_attempts:
                self.pending.put_back(Attempt(attempt.prompt, retry))  # any endpoint may take it
                if too_many_failures:
                    pool.drop(endpoint)
                    return
                await asyncio.sleep(backoff_s(retry))
                continue
            self._settle(row, permanent=outcome.permanent)

    def _settle(self, row: GenerationRow, permanent: bool) -> None:
        self.stage.record(row, permanent=permanent and row["status"] != "ok")
        ok = row["status"] == "ok"
        usage = row.get("usage")
        self.progress.update(
            ok=int(ok), failed=int(not ok), tokens=(usage.get("completion_tokens") if usage else None) or 0
        )
        self.pending.settled()
