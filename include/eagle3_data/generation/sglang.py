"""Local generation: SGLang `/generate` with exact output ids, data parallel across endpoints.

Each endpoint gets `in_flight` worker coroutines pulling from one shared queue, so a slot that
frees on any GPU node takes the next prompt at once (least-loaded dispatch without a scheduler)
and every endpoint stays `in_flight` deep. A transport failure puts the prompt back on the queue
for any endpoint while the failing worker backs off, so one sick node slows nothing else.
Prompts go as ids rendered by the tokenizer's chat template, never as text, so the prompt ids
recorded are the ones the model saw.

SGLang 0.5.23's protocol, as its source has it (srt/managers/io_struct.py, tokenizer_manager.py,
sampling_params.py, http_server.py):
- `rid` must be unique while a request is registered, and the server notices a dropped client
  only every few seconds (a hung engine never lets it go): each request gets a fresh
  `rid` = `{sample_id}.{run}.{attempt}`, `run` a random tag of this stage run, so a task retried
  after a kill does not reuse the rids its killed attempt left registered.
- unknown keys inside `sampling_params` are a 400 on every request: they are checked against
  SAMPLING_KEYS before any request (`check_sampling_params`).
- `/health` runs a one-token generation and answers 503 while the server warms up: endpoints are
  polled concurrently until ready or `warmup_timeout_s`; one is dropped only after
  `max_endpoint_failures` consecutive failures and re-admitted when its `/health` answers again.
- `stop_token_ids` is always sent, from the audited ids (else the server stops on the union of
  the eos ids in the checkpoint's configs).
- `output_ids` include the matched stop token and `meta_info.finish_reason` names it; both are
  recorded as given (the validator decides what a row's stop means), and `len(output_ids)` must
  equal `meta_info.completion_tokens`. `weight_version` (from `/model_info`, or the deprecated
  `/get_model_info`) goes into every row's provenance.
- In flight per endpoint: `in_flight_per_endpoint` when set (the override); else what the endpoint
  reports as its capacity, SGLang's `max_running_requests` from `/server_info` (`/get_server_info`
  before 0.5.23 renamed it; server args merged with scheduler info, so the value the server was
  launched with, per data-parallel rank summed from `internal_states` when the top level has none);
  else DEFAULT_IN_FLIGHT. More in flight than the server runs only queues in its waiting list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import aiohttp

from eagle3_data.errors import EndpointUnavailable, UserError
from eagle3_data.generation.checkpoint import (
    Prompt,
    StageRun,
    base_row,
    failed_row,
    generation_mode,
    parse_prompts,
    reused_summary,
    sampling_for,
)
from eagle3_data.generation.progress import Progress, tick_every
from eagle3_data.generation.retry import PERMANENT_STATUS, backoff_s

log = logging.getLogger(__name__)

SOURCE = "sglang"
DEFAULT_IN_FLIGHT = 64  # per endpoint, when neither the config nor the endpoint says
MAX_IN_FLIGHT = 4096  # a reported capacity is clamped to the config's own bound

# SGLang 0.5.23 SamplingParams.__init__ (srt/sampling/sampling_params.py): any other key inside
# `sampling_params` is a 400 "Unknown sampling parameter" on every request.
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n", "json_schema", "regex", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
})
_RENAMED = {"seed": "sampling_seed", "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


def check_sampling_params(params: Mapping[str, object], *, where: str = "generation.sampling") -> None:
    """A config error naming the key, instead of a 400 on every request."""
    for key in params:
        if key not in SAMPLING_KEYS:
            hint = f" (SGLang's key is {_RENAMED[key]!r})" if key in _RENAMED else ""
            raise UserError(f"{where}: {key!r} is not an SGLang sampling parameter{hint}; "
                            f"accepted: {', '.join(sorted(SAMPLING_KEYS))}")


def generate_local(store, ref, prompts: Iterable[dict], tokenizer, endpoints: Sequence[str], sampling: dict,
                   **options) -> dict:
    """Generate every pending prompt of `ref.dataset` on SGLang `endpoints`; summary dict (see StageRun).

    `sampling`: `thinking` (required: the generation mode, bound once into the output format that
    renders the prompts and names the stop ids) + SGLang sampling params (temperature, top_p,
    max_new_tokens, ...; checked against SAMPLING_KEYS). Resumes a killed attempt: committed
    sample_ids are skipped, journaled answers replayed. `rerun=True` reopens a complete stage
    (parts re-verified, only missing or corrupt rows redone). `options`: see `run_local_stage`.
    """
    return run_local_stage(_SGLangRun, store, ref, prompts, tokenizer, endpoints, sampling, **options)


def run_local_stage(engine: type[_SGLangRun], store, ref, prompts: Iterable[dict], tokenizer,
                    endpoints: Sequence[str], sampling: dict, *, in_flight_per_endpoint: int | None = None,
                    rows_per_part: int = 256, model: str = "", inputs: list | None = None,
                    progress: Progress | None = None, max_attempts: int = 5, request_timeout_s: float = 3600.0,
                    journal_dir=None, flush_interval_s: float = 30.0,
                    routes: tuple[str, ...] | None = ("local", "both"), rerun: bool = False,
                    warmup_timeout_s: float = 600.0, max_endpoint_failures: int = 3,
                    health_interval_s: float = 2.0, side_files: dict[str, bytes] | None = None,
                    unreachable_timeout_s: float = 15.0, connect_timeout_s: float = 5.0) -> dict:
    """One local-generation stage on `engine`'s wire format (SGLang's or vLLM's): the same
    checkpoints, journal, resume, retries and record schema whichever engine answers."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256

    if store.is_complete(ref) and not rerun:
        return reused_summary(store, ref)
    if not endpoints:
        raise UserError(f"generate_local: no {engine.ENGINE} endpoints given")
    sampling = dict(sampling)
    fmt = get_output_format(tokenizer, thinking=generation_mode(sampling, "generate_local"))
    request = engine.request_sampling(sampling)
    request.setdefault("stop_token_ids", list(fmt.stop_token_ids))
    rows = parse_prompts(prompts, ref.dataset, routes)
    tok_sha = tokenizer_files_sha256(tokenizer)
    params = {"source": engine.SOURCE, "model": model, "sampling": dict(request, thinking=fmt.thinking)}
    progress = progress or Progress()
    with StageRun(store, ref, rows, rows_per_part=rows_per_part, params=params, inputs=inputs,
                  tokenizer_sha256=tok_sha, template_sha256=chat_template_sha256(tokenizer),
                  journal_dir=journal_dir, flush_interval_s=flush_interval_s, rerun=rerun,
                  side_files=side_files) as run:
        label = f"generate_local {ref.dataset}" + ("" if engine.SOURCE == SOURCE else f" ({engine.SOURCE})")
        progress.start(len(rows), len(rows) - run.pending_count, label=label)
        client = engine(run, fmt, list(endpoints), request, in_flight_per_endpoint, max_attempts,
                        request_timeout_s, progress, model, tok_sha, warmup_timeout_s, max_endpoint_failures,
                        health_interval_s, unreachable_timeout_s, connect_timeout_s)
        try:
            stopped = asyncio.run(client.run())
        finally:
            progress.close()  # a bar left open would swallow the start of the error's line
        run.finish(stopped, extra={"endpoints": len(endpoints), "max_in_flight": client.max_in_flight,
                                   **client.timing(), **client.finish_extra()})
    return run.result


class _SGLangRun:
    """Shared queue + per-endpoint workers, health, drop/re-admit and retries for one stage.
    Subclasses change only the wire format: `request_sampling`, `_request`, `_answer`."""

    SOURCE = SOURCE
    ENGINE = "SGLang"
    CONNECTION = "the sglang_default connection, or --endpoint"
    # where the engine reports its capacity (max_running_requests); () = it does not
    CAPACITY_PATHS: tuple[str, ...] = ("/server_info", "/get_server_info")

    @staticmethod
    def request_sampling(sampling: dict) -> dict:
        check_sampling_params(sampling)
        return sampling

    def finish_extra(self) -> dict:
        return {"weight_versions": self.weight_version}

    def __init__(self, run: StageRun, fmt, endpoints, sampling, in_flight, max_attempts, timeout_s,
                 progress, model, tok_sha, warmup_timeout_s, max_endpoint_failures, health_interval_s,
                 unreachable_timeout_s, connect_timeout_s):
        self.stage, self.fmt, self.endpoints = run, fmt, [e.rstrip("/") for e in endpoints]
        self.sampling, self.thinking, self.in_flight = sampling, fmt.thinking, in_flight  # None: ask the endpoint
        self.max_attempts, self.timeout_s, self.progress = max_attempts, timeout_s, progress
        self.model, self.tok_sha = model, tok_sha
        self.warmup_timeout_s, self.max_failures = warmup_timeout_s, max_endpoint_failures
        self.health_interval_s = health_interval_s
        self.unreachable_timeout_s, self.connect_timeout_s = unreachable_timeout_s, connect_timeout_s
        self.run_tag = uuid.uuid4().hex[:8]
        self.busy = dict.fromkeys(self.endpoints, 0)
        self.max_in_flight = dict.fromkeys(self.endpoints, 0)
        self.failures = dict.fromkeys(self.endpoints, 0)  # consecutive, per endpoint
        self.weight_version: dict[str, str | None] = {}
        self.capacity: dict[str, int] = {}  # workers per endpoint
        self.capacity_source: dict[str, str] = {}  # "config" | "server_info" | "default"
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()
        self.workers: dict[str, list[asyncio.Task]] = {}
        self.stop_reason: str | None = None
        self.feed_error: Exception | None = None

    async def run(self) -> str | None:
        # aiohttp, not httpx: httpx's connection pool costs several ms of CPU per request at this
        # depth and left the slots 60% empty against a fast server (benchmarks/RESULTS.md).
        # no pool limit: the workers bound the connections (per endpoint, known only after /server_info)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            self.http = http
            log.info("%s: waiting for %d endpoint(s) to answer /health: %s", self.ENGINE, len(self.endpoints),
                     ", ".join(self.endpoints))
            problems = await asyncio.gather(*(self._wait_ready(e) for e in self.endpoints))
            for e, problem in zip(self.endpoints, problems):
                if problem is not None:
                    log.warning("%s endpoint %s: %s; not used", self.ENGINE, e, problem)
            healthy = [e for e, problem in zip(self.endpoints, problems) if problem is None]
            if not healthy:
                raise EndpointUnavailable(
                    f"no {self.ENGINE} endpoint is usable: "
                    + "; ".join(f"{e}: {problem}" for e, problem in zip(self.endpoints, problems))
                    + f". Check the URLs ({self.CONNECTION}) and that the servers run; a server still loading its "
                    "model that does not listen yet: raise generation.local.unreachable_timeout_s")
            # fresh prompts come from the stage's one-shot iterator as workers free up (only the
            # prompts in flight are decoded); the queue holds those handed back for another try
            self.feed = iter(self.stage.pending)
            self.queue: asyncio.Queue = asyncio.Queue()
            self.outstanding = self.stage.pending_count
            self.all_done = asyncio.Event()
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
        """Poll `/health` until it answers 200 (None), else say what was tried. A server that
        answers (503 while it loads its model) is waited for up to the warm-up; one that accepts no
        connection at all (nothing listening, no route to it) is given up after
        `unreachable_timeout_s` without an answer, so a wrong URL is named in seconds."""
        started = time.monotonic()
        answered_at, tries, last, note_at = started, 0, "", started + 10.0
        while True:
            status = await self._health(endpoint)
            tries += 1
            now = time.monotonic()
            if status == 200:
                self.weight_version[endpoint] = await self._weight_version(endpoint)
                await self._size(endpoint)
                return None
            last = f"HTTP {status}" if isinstance(status, int) else status.what
            if isinstance(status, int) or status.connected:
                answered_at = now
            tried = f"{tries} tries of GET {endpoint}/health over {now - started:.0f} s, last: {last}"
            if now - answered_at >= self.unreachable_timeout_s:
                return f"no connection for {now - answered_at:.0f} s ({tried})"
            if now - started >= self.warmup_timeout_s:
                return f"not ready after {self.warmup_timeout_s:g} s of warm-up ({tried})"
            if now >= note_at:
                log.info("%s endpoint %s: waiting for /health (%s)", self.ENGINE, endpoint, tried)
                note_at = now + 30.0
            await asyncio.sleep(min(self.health_interval_s, max(0.0, started + self.warmup_timeout_s - now)))

    async def _health(self, endpoint: str) -> int | HealthFailure:
        """The status of `/health`, or what failed (and whether a connection was made at all)."""
        # SGLang's /health itself waits up to ~20 s for its one-token generation; the connection
        # attempt is bounded on its own, so a host that drops SYNs is not waited on for 30 s.
        try:
            async with self.http.get(f"{endpoint}/health", timeout=aiohttp.ClientTimeout(
                    total=30.0, sock_connect=self.connect_timeout_s)) as r:
                return r.status
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            return HealthFailure(_describe(exc), connected=False)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return HealthFailure(_describe(exc), connected=True)

    async def _weight_version(self, endpoint: str) -> str | None:
        for path in ("/model_info", "/get_model_info"):
            try:
                async with self.http.get(f"{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                    if r.status == 200:
                        info = await r.json(content_type=None)
                        return info.get("weight_version") if isinstance(info, dict) else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
        return None

    async def _size(self, endpoint: str) -> None:
        """Workers for `endpoint`: the configured override, else its reported capacity, else the default."""
        if self.in_flight is not None:
            self.capacity[endpoint], self.capacity_source[endpoint] = self.in_flight, "config"
            return
        reported = await self._reported_capacity(endpoint)
        if reported is None:
            self.capacity[endpoint], self.capacity_source[endpoint] = DEFAULT_IN_FLIGHT, "default"
        else:
            self.capacity[endpoint], self.capacity_source[endpoint] = min(reported, MAX_IN_FLIGHT), "server_info"
        log.info("%s endpoint %s: %d in flight (%s)", self.ENGINE, endpoint, self.capacity[endpoint],
                 "its max_running_requests" if reported is not None else
                 "default: it reports no capacity; set generation.local.in_flight_per_endpoint")

    async def _reported_capacity(self, endpoint: str) -> int | None:
        for path in self.CAPACITY_PATHS:
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
        return {"in_flight": dict(self.capacity), "in_flight_source": dict(self.capacity_source),
                "answered": self.answered, "wall_s": round(time.monotonic() - self.started, 3),
                "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None}

    def _admit(self, endpoint: str) -> None:
        self.failures[endpoint] = 0
        n = self.capacity.get(endpoint, self.in_flight or DEFAULT_IN_FLIGHT)
        self.workers[endpoint] = [asyncio.create_task(self._worker(endpoint)) for _ in range(n)]

    def _drop(self, endpoint: str) -> None:
        """After `max_endpoint_failures` consecutive failures: its workers stop (their prompts go
        back on the queue) and `_readmit` watches its /health."""
        if endpoint not in self.workers:
            return
        log.warning("SGLang endpoint %s: %d consecutive failures; dropped until /health answers again",
                    endpoint, self.failures[endpoint])
        current = asyncio.current_task()
        for t in self.workers.pop(endpoint):
            if t is not current:
                t.cancel()

    async def _readmit(self) -> None:
        """Re-admit dropped endpoints that come back; stop the stage when none is left for a warm-up."""
        alone_since = None
        while True:
            await asyncio.sleep(self.health_interval_s)
            for e in [e for e in self.endpoints if e not in self.workers]:
                if await self._health(e) == 200:
                    log.info("SGLang endpoint %s: healthy again; re-admitted", e)
                    self.weight_version[e] = await self._weight_version(e)
                    await self._size(e)
                    self._admit(e)
            if self.workers:
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > self.warmup_timeout_s:
                self.stop_reason = f"every SGLang endpoint failed and none came back within {self.warmup_timeout_s:g} s"
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
        while True:
            p, attempts = await self._take()
            self.busy[endpoint] += 1
            self.max_in_flight[endpoint] = max(self.max_in_flight[endpoint], self.busy[endpoint])
            started = time.monotonic()
            try:
                row, permanent, endpoint_failed = await self._one(endpoint, p, attempts)
            except asyncio.CancelledError:
                self.queue.put_nowait((p, attempts))  # its endpoint was dropped: another one takes it
                raise
            finally:
                self.busy[endpoint] -= 1
            if row["status"] == "ok":
                self.latency_sum += time.monotonic() - started
                self.answered += 1
            self.failures[endpoint] = self.failures[endpoint] + 1 if endpoint_failed else 0
            if row["status"] == "failed" and not permanent and attempts + 1 < self.max_attempts:
                self.queue.put_nowait((p, attempts + 1))  # any endpoint may take it
                if self.failures[endpoint] >= self.max_failures:
                    self._drop(endpoint)
                    return
                await asyncio.sleep(backoff_s(attempts + 1))
                continue
            self._settle(row, permanent=permanent)

    def _settle(self, row: dict, permanent: bool) -> None:
        self.stage.record(row, permanent=permanent and row["status"] == "failed")
        ok = row["status"] == "ok"
        self.progress.update(ok=int(ok), failed=int(not ok),
                             tokens=(row.get("usage") or {}).get("completion_tokens") or 0)
        self.outstanding -= 1
        if self.outstanding == 0:
            self.all_done.set()

    async def _one(self, endpoint: str, p: Prompt, attempt: int) -> tuple[dict, bool, bool]:
        """(row, permanent, endpoint failed): an ok row, or a failed row and whether it is final
        (no attempt can fix it); transport errors and 5xx count against the endpoint."""
        source = self.SOURCE
        try:
            prompt_ids = self.fmt.generation_prompt_ids(p.messages, p.tools)
        except Exception as exc:  # the template refuses this conversation: permanent
            return failed_row(p, None, source, f"chat template: {exc}"), True, False
        row = base_row(p, prompt_ids, source)
        sampling = sampling_for(p, self.sampling)
        rid = f"{p.sample_id}.{self.run_tag}.{attempt}"  # fresh per request: SGLang refuses a rid still registered
        path, body = self._request(endpoint, prompt_ids, sampling, rid)
        headers = {"X-Request-Id": rid, "X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}
        started = time.monotonic()
        try:
            async with self.http.post(f"{endpoint}{path}", json=body, headers=headers) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return failed_row(p, prompt_ids, source, f"transport: {type(exc).__name__} from {endpoint}"), False, True
        if status != 200:
            reason = f"HTTP {status} from {endpoint}: {error_message(text)[:300]}"
            return failed_row(p, prompt_ids, source, reason), status in PERMANENT_STATUS, status >= 500
        try:
            ids, finish, engine_provenance = self._answer(json.loads(text), prompt_ids, endpoint)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return failed_row(p, prompt_ids, source, f"malformed answer from {endpoint}: {exc}"), False, False
        if finish["type"] not in ("stop", "length"):
            return failed_row(p, prompt_ids, source, f"finish_reason {finish!r} from {endpoint}"), False, False
        msg = self.fmt.parse_ids(ids, finish["type"]).message
        end = self.fmt.reasoning_end_id
        reasoning_tokens = (ids.index(end) if end in ids else len(ids)) if self.thinking and end is not None else 0
        row.update(
            output_ids=ids,
            reasoning=msg.reasoning,
            content=msg.content,
            tool_calls=json.dumps([c.to_openai() for c in msg.tool_calls], ensure_ascii=False) if msg.tool_calls else None,
            finish_reason=finish["type"],
            usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                   "reasoning_tokens": reasoning_tokens, "cost_usd": None},
            provenance=json.dumps({
                "model": self.model, "engine": source, "endpoint": endpoint, "sampling": sampling,
                "thinking": self.thinking, "tokenizer_sha256": self.tok_sha, "rid": rid,
                "e2e_latency": round(time.monotonic() - started, 4), "finish_reason": finish,
                "generated_at": time.time(), **engine_provenance,
            }, sort_keys=True),
        )
        return row, False, False

    def _request(self, endpoint: str, prompt_ids: list[int], sampling: dict, rid: str) -> tuple[str, dict]:
        return "/generate", {"input_ids": prompt_ids, "sampling_params": sampling, "rid": rid}

    def _answer(self, answer, prompt_ids: list[int], endpoint: str) -> tuple[list[int], dict, dict]:
        """(output ids as given, finish_reason object, engine-specific provenance)."""
        ids, finish, meta = check_answer(answer)
        return ids, finish, {
            "e2e_latency": meta.get("e2e_latency"), "cached_tokens": meta.get("cached_tokens"),
            "weight_version": meta.get("weight_version") or self.weight_version.get(endpoint),
        }


class HealthFailure(NamedTuple):
    """A `/health` poll that got no status: what failed, and whether the TCP connection was made
    (a server that accepts connections is alive, if slow; one that refuses them may not exist)."""

    what: str
    connected: bool


def _describe(exc: BaseException) -> str:
    """An aiohttp/timeout failure in one short line: its type and what it says."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def server_capacity(info) -> int | None:
    """`max_running_requests` of a `/server_info` answer: the top-level server arg, else the sum
    over the data-parallel ranks' `internal_states`; None when neither is a positive int."""
    def positive(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    if not isinstance(info, dict):
        return None
    if (top := positive(info.get("max_running_requests"))) is not None:
        return top
    ranks = [positive(s.get("max_running_requests")) for s in info.get("internal_states") or [] if isinstance(s, dict)]
    return sum(ranks) if ranks and None not in ranks else None


def check_answer(answer) -> tuple[list[int], dict, dict]:
    """(output_ids as given, finish_reason object as given, meta_info) of a /generate answer.
    SGLang's output_ids run through the matched stop token; they must number `completion_tokens`."""
    if isinstance(answer, list):
        answer = answer[0]
    ids = answer["output_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("output_ids is not a list of ints")
    meta = answer["meta_info"]
    finish = meta["finish_reason"]
    if isinstance(finish, str):
        finish = {"type": finish}
    if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
        raise ValueError(f"meta_info.finish_reason {finish!r}")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise ValueError(f"len(output_ids) = {len(ids)} but meta_info.completion_tokens = {completion}")
    return ids, finish, meta


def error_message(text: str) -> str:
    """SGLang's error bodies: `{"error": "<str>"}` (schema errors) or `{"error": {"message": ...}}`;
    anything else verbatim."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, str):
        return err
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return text


def sglang_endpoints(value: str | Sequence[str]) -> list[str]:
    """Endpoints from a connection field: a list, or one string of comma/space separated URLs."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    for e in items:
        if not e.startswith(("http://", "https://")):
            raise UserError(f"SGLang endpoint {e!r}: expected an http(s) URL")
    return items

