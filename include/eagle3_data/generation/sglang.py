"""Local generation: SGLang `/generate` with exact output ids, data parallel across endpoints.

Each endpoint gets `in_flight` worker coroutines pulling from one shared queue, so a slot that
frees on any GPU node takes the next prompt at once (least-loaded dispatch without a scheduler)
and every endpoint stays `in_flight` deep. A transport failure puts the prompt back on the queue
for any endpoint while the failing worker backs off, so one sick node slows nothing else.
Prompts go as ids rendered by the tokenizer's chat template, never as text, so the prompt ids
recorded are the ones the model saw.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Sequence

import aiohttp

from eagle3_data.errors import UserError
from eagle3_data.generation.checkpoint import Prompt, StageRun, base_row, parse_prompts, reused_summary, sampling_for
from eagle3_data.generation.progress import Progress
from eagle3_data.generation.retry import PERMANENT_STATUS, backoff_s

log = logging.getLogger(__name__)

SOURCE = "sglang"


def generate_local(store, ref, prompts: Iterable[dict], tokenizer, endpoints: Sequence[str], sampling: dict, *,
                   in_flight_per_endpoint: int = 64, rows_per_part: int = 256, model: str = "",
                   inputs: list | None = None, progress: Progress | None = None, max_attempts: int = 5,
                   request_timeout_s: float = 3600.0, journal_dir=None, flush_interval_s: float = 30.0,
                   routes: tuple[str, ...] | None = ("local", "both")) -> dict:
    """Generate every pending prompt of `ref.dataset` on `endpoints`; summary dict (see StageRun).

    `sampling`: temperature, top_p, max_new_tokens, thinking (+ any other SGLang sampling param).
    Resumes a killed attempt: committed sample_ids are skipped, journaled answers replayed.
    """
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256

    if store.is_complete(ref):
        return reused_summary(store, ref)
    if not endpoints:
        raise UserError("generate_local: no SGLang endpoints given")
    fmt = get_output_format(tokenizer)
    rows = parse_prompts(prompts, ref.dataset, routes)
    sampling = dict(sampling)
    thinking = bool(sampling.pop("thinking", True))
    tok_sha = tokenizer_files_sha256(tokenizer)
    params = {"source": SOURCE, "model": model, "sampling": dict(sampling, thinking=thinking)}
    progress = progress or Progress()
    with StageRun(store, ref, rows, rows_per_part=rows_per_part, params=params, inputs=inputs,
                  tokenizer_sha256=tok_sha, template_sha256=chat_template_sha256(tokenizer),
                  journal_dir=journal_dir, flush_interval_s=flush_interval_s) as run:
        progress.start(len(rows), len(rows) - len(run.pending), label=f"generate_local {ref.dataset}")
        client = _SGLangRun(run, fmt, list(endpoints), sampling, thinking, in_flight_per_endpoint, max_attempts,
                            request_timeout_s, progress, model, tok_sha)
        stopped = asyncio.run(client.run())
        progress.close()
        run.finish(stopped, extra={"endpoints": len(endpoints), "max_in_flight": client.max_in_flight})
    return run.result


class _SGLangRun:
    def __init__(self, run: StageRun, fmt, endpoints, sampling, thinking, in_flight, max_attempts, timeout_s,
                 progress, model, tok_sha):
        self.stage, self.fmt, self.endpoints = run, fmt, [e.rstrip("/") for e in endpoints]
        self.sampling, self.thinking, self.in_flight = sampling, thinking, in_flight
        self.max_attempts, self.timeout_s, self.progress = max_attempts, timeout_s, progress
        self.model, self.tok_sha = model, tok_sha
        self.busy = dict.fromkeys(self.endpoints, 0)
        self.max_in_flight = dict.fromkeys(self.endpoints, 0)

    async def run(self) -> str | None:
        # aiohttp, not httpx: httpx's connection pool costs several ms of CPU per request at this
        # depth and left the slots 60% empty against a fast server (benchmarks/RESULTS.md).
        connector = aiohttp.TCPConnector(limit=self.in_flight * len(self.endpoints) + 8)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=10.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            healthy = await self._healthy(http)
            queue: asyncio.Queue = asyncio.Queue()
            for p in self.stage.pending:
                queue.put_nowait((p, 0))
            self.outstanding = len(self.stage.pending)
            self.all_done = asyncio.Event()
            if not self.outstanding:
                return None
            workers = [asyncio.create_task(self._worker(http, e, queue)) for e in healthy for _ in range(self.in_flight)]
            ticker = asyncio.create_task(self._tick())
            try:
                await self.all_done.wait()
            finally:
                for w in workers + [ticker]:
                    w.cancel()
                await asyncio.gather(*workers, ticker, return_exceptions=True)
        return None

    async def _healthy(self, http: aiohttp.ClientSession) -> list[str]:
        ok = []
        for e in self.endpoints:
            try:
                async with http.get(f"{e}/health", timeout=aiohttp.ClientTimeout(total=10.0)) as r:
                    if r.status == 200:
                        ok.append(e)
                        continue
                    log.warning("SGLang endpoint %s: /health answered %d; not used", e, r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("SGLang endpoint %s: /health failed (%s); not used", e, type(exc).__name__)
        if not ok:
            raise UserError(f"no healthy SGLang endpoint among {self.endpoints}: check the sglang connection")
        return ok

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.progress.tick()

    async def _worker(self, http: aiohttp.ClientSession, endpoint: str, queue: asyncio.Queue) -> None:
        while True:
            p, attempts = await queue.get()
            self.busy[endpoint] += 1
            self.max_in_flight[endpoint] = max(self.max_in_flight[endpoint], self.busy[endpoint])
            try:
                row, retry = await self._one(http, endpoint, p)
            finally:
                self.busy[endpoint] -= 1
            if retry and attempts + 1 < self.max_attempts:
                queue.put_nowait((p, attempts + 1))  # any endpoint may take it
                await asyncio.sleep(backoff_s(attempts + 1))
                continue
            self._settle(row, permanent=not retry)

    def _settle(self, row: dict, permanent: bool) -> None:
        self.stage.record(row, permanent=permanent and row["status"] == "failed")
        ok = row["status"] == "ok"
        self.progress.update(ok=int(ok), failed=int(not ok),
                             tokens=(row.get("usage") or {}).get("completion_tokens") or 0)
        self.outstanding -= 1
        if self.outstanding == 0:
            self.all_done.set()

    async def _one(self, http: aiohttp.ClientSession, endpoint: str, p: Prompt) -> tuple[dict, bool]:
        """(row, retryable): an ok row, or a failed row and whether another attempt may fix it."""
        try:
            prompt_ids = self.fmt.generation_prompt_ids(p.messages, p.tools, thinking=self.thinking)
        except Exception as exc:  # the template refuses this conversation: permanent
            return _failed(p, None, f"chat template: {exc}"), False
        row = base_row(p, prompt_ids, SOURCE)
        sampling = sampling_for(p, self.sampling)
        body = {"input_ids": prompt_ids, "sampling_params": sampling, "rid": p.sample_id}
        headers = {"X-Eagle3-Dataset": p.dataset, "X-Eagle3-Sample-Id": p.sample_id}
        try:
            async with http.post(f"{endpoint}/generate", json=body, headers=headers) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _failed(p, prompt_ids, f"transport: {type(exc).__name__} from {endpoint}"), True
        if status != 200:
            reason = f"HTTP {status} from {endpoint}: {text[:200]}"
            return _failed(p, prompt_ids, reason), status not in PERMANENT_STATUS
        try:
            answer = json.loads(text)
            ids, finish = self._normalise(answer)
        except (ValueError, KeyError, TypeError) as exc:
            return _failed(p, prompt_ids, f"malformed answer from {endpoint}: {exc}"), True
        parsed = self.fmt.parse_ids(ids, finish, thinking=self.thinking)
        msg = parsed.message
        meta = answer.get("meta_info") or {}
        reasoning_tokens = ids.index(self.fmt.special_ids["</think>"]) if self.thinking and self.fmt.special_ids["</think>"] in ids else (
            len(ids) if self.thinking and finish == "length" else 0)
        row.update(
            output_ids=ids,
            reasoning=msg.reasoning,
            content=msg.content,
            tool_calls=json.dumps([c.to_openai() for c in msg.tool_calls], ensure_ascii=False) if msg.tool_calls else None,
            finish_reason=finish,
            usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                   "reasoning_tokens": reasoning_tokens, "cost_usd": None},
            provenance=json.dumps({
                "model": self.model, "endpoint": endpoint, "sampling": sampling, "thinking": self.thinking,
                "tokenizer_sha256": self.tok_sha, "rid": meta.get("id"), "e2e_latency": meta.get("e2e_latency"),
                "cached_tokens": meta.get("cached_tokens"), "generated_at": time.time(),
            }, sort_keys=True),
        )
        return row, False

    def _normalise(self, answer: dict) -> tuple[list[int], str]:
        """Output ids WITH the stop id when generation stopped (SGLang may or may not include it)."""
        if isinstance(answer, list):
            answer = answer[0]
        ids = answer["output_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("output_ids is not a list of ints")
        finish = answer["meta_info"]["finish_reason"]
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "length":
            if ids and ids[-1] in self.fmt.stop_token_ids:
                raise ValueError("finish_reason length but output ends with a stop id")
            return ids, "length"
        if kind != "stop":
            raise ValueError(f"finish_reason {finish!r}")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        if ids and ids[-1] in self.fmt.stop_token_ids:
            return ids, "stop"
        if isinstance(matched, int) and matched in self.fmt.stop_token_ids:
            return ids + [matched], "stop"
        raise ValueError(f"finish_reason stop with matched={matched!r}, not one of the stop ids {self.fmt.stop_token_ids}")


def _failed(p: Prompt, prompt_ids, reason: str) -> dict:
    row = base_row(p, prompt_ids, SOURCE)
    row.update(status="failed", error=reason)
    return row


def sglang_endpoints(value: str | Sequence[str]) -> list[str]:
    """Endpoints from a connection field: a list, or one string of comma/space separated URLs."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    for e in items:
        if not e.startswith(("http://", "https://")):
            raise UserError(f"SGLang endpoint {e!r}: expected an http(s) URL")
    return items

