"""PROTOTYPE (issue 14, deliverable 6): overflow generation with the requests spread over several
client processes, each with its own event loop and its own openai SDK client.

Why: one event loop saturates one core at ~205 req/s (benchmarks/RESULTS.md: the SDK's request
path costs ~1.7 ms CPU per call), so C=256 at L=0.5 s (ideal 512 req/s) cannot be reached by any
single-loop client that keeps the SDK. Here the parent keeps everything that must stay in one
place (the StageRun journal and checkpointed parts, the budget, progress, dispatch order) and
forked workers do only `_OverflowRun._sample` (the same SDK call, auth, error classes, retries
and row building as `generate_overflow`, reused, not copied): the parent sends a prompt index,
the worker answers (row, permanent) or "stopped" (HTTP 401/402). The stage's params, and so its
manifest and reuse rules, are exactly those of `generate_overflow`.

Not wired into the pipeline; `benchmarks/overflow_pool.py` measures it against `generate_overflow`
in the same run. Workers are forked before the stage writer starts its threads.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterable

from eagle3_data.errors import UserError
from eagle3_data.generation.checkpoint import StageRun, generation_mode, overflow_params, parse_prompts, reused_summary
from eagle3_data.generation.openrouter import SOURCE, Budget, _OverflowRun
from eagle3_data.generation.progress import Progress


def generate_overflow_pool(store, ref, prompts: Iterable[dict], tokenizer, base_url: str, api_key: str, model: str,
                           provider: dict | None, budget_usd: float | None, *, processes: int = 2,
                           sampling: dict | None = None, concurrency: int = 256, rows_per_part: int = 64,
                           inputs: list | None = None, progress: Progress | None = None, max_attempts: int = 6,
                           request_timeout_s: float = 600.0, first_cost_estimate_usd: float = 0.01,
                           journal_dir=None, flush_interval_s: float = 30.0,
                           routes: tuple[str, ...] | None = ("overflow", "both"),
                           price_usd_per_mtok: dict | None = None) -> dict:
    """`generate_overflow` with `processes` client processes sharing `concurrency`; same summary."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256

    if store.is_complete(ref):
        return reused_summary(store, ref)
    if not api_key:
        raise UserError("generate_overflow: no API key (set the openrouter connection's password or OPENROUTER_API_KEY)")
    if processes < 1:
        raise UserError(f"processes must be >= 1, got {processes}")
    sampling = dict(sampling or {})
    thinking = generation_mode(sampling, "generate_overflow")
    reasoning, params = overflow_params(model, provider, sampling, thinking, base_url, SOURCE)
    rows = parse_prompts(prompts, ref.dataset, routes)
    tok_sha = tokenizer_files_sha256(tokenizer)
    fmt = get_output_format(tokenizer, thinking=thinking)
    per_worker = -(-concurrency // processes)
    # what a worker needs to build its own _OverflowRun (no stage, no progress: the parent has them)
    worker_args = (fmt, base_url, api_key, model, provider or {}, sampling, thinking, reasoning, per_worker,
                   max_attempts, request_timeout_s, tok_sha, budget_usd, price_usd_per_mtok)
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(processes)]
    workers = [ctx.Process(target=_worker_main, args=(child, rows, worker_args), daemon=True) for _, child in pipes]
    for w in workers:
        w.start()
    for _, child in pipes:
        child.close()
    conns = [parent for parent, _ in pipes]
    progress = progress or Progress()
    try:
        with StageRun(store, ref, rows, rows_per_part=rows_per_part, params=params, inputs=inputs,
                      tokenizer_sha256=tok_sha, template_sha256=chat_template_sha256(tokenizer),
                      journal_dir=journal_dir, flush_interval_s=flush_interval_s) as run:
            progress.start(len(rows), len(rows) - len(run.pending), label=f"generate_overflow {ref.dataset}")
            budget = Budget(budget_usd, run.spent_before_usd, first_cost_estimate_usd, sampling.get("max_new_tokens"))
            index = {p.sample_id: i for i, p in enumerate(rows)}
            stopped = asyncio.run(_dispatch(run, [index[p.sample_id] for p in run.pending], conns, concurrency,
                                            budget, progress))
            progress.close()
            run.finish(stopped, extra={"budget_usd": budget_usd, "spent_total_usd": round(budget.spent, 6)})
    finally:
        for c in conns:
            try:
                c.send(None)
            except OSError:
                pass
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    return run.result


async def _dispatch(stage: StageRun, pending: list[int], conns, concurrency: int, budget: Budget,
                    progress: Progress) -> str | None:
    """Keep `concurrency` requests in flight over the workers (least loaded first), admit each
    under the budget exactly as `_OverflowRun._worker` does, and record answers as they come."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    queue = iter(pending)
    in_flight = [0] * len(conns)
    state = {"stopped": None, "exhausted": False}

    def fill() -> None:
        while state["stopped"] is None and not state["exhausted"] and sum(in_flight) < concurrency:
            total = sum(in_flight)
            if not budget.allows(total):
                if total == 0 or not budget.allows(0):
                    state["stopped"] = "budget"
                break  # an answer will settle the estimate and call fill() again
            i = next(queue, None)
            if i is None:
                state["exhausted"] = True
                break
            w = min(range(len(conns)), key=in_flight.__getitem__)
            conns[w].send(i)
            in_flight[w] += 1
        if sum(in_flight) == 0 and (state["stopped"] or state["exhausted"]):
            done.set()

    def on_answer(w: int) -> None:
        while conns[w].poll():
            try:
                kind, _, *rest = conns[w].recv()
            except EOFError:
                loop.remove_reader(conns[w].fileno())
                state["stopped"] = state["stopped"] or "worker_died"
                in_flight[w] = 0
                break
            in_flight[w] -= 1
            if kind == "stopped":
                state["stopped"] = state["stopped"] or rest[0]
                continue
            row, permanent = rest
            usage = row.get("usage") or {}
            cost = usage.get("cost_usd") or 0.0
            budget.add(cost, usage.get("completion_tokens"))
            stage.record(row, permanent=permanent)
            ok = row["status"] == "ok"
            progress.update(ok=int(ok), failed=int(not ok), cost_usd=cost, tokens=usage.get("completion_tokens") or 0)
        fill()

    for w, c in enumerate(conns):
        loop.add_reader(c.fileno(), on_answer, w)
    try:
        fill()
        await done.wait()
    finally:
        for c in conns:
            loop.remove_reader(c.fileno())
    return state["stopped"]


def _worker_main(conn, rows, worker_args) -> None:
    asyncio.run(_worker_loop(conn, rows, worker_args))


async def _worker_loop(conn, rows, worker_args) -> None:
    """One event loop, one SDK client: sample every index the parent sends until it sends None."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAioHttpClient

    (fmt, base_url, api_key, model, provider, sampling, thinking, reasoning, concurrency, max_attempts, timeout_s,
     tok_sha, budget_usd, prices) = worker_args
    runner = _OverflowRun(None, fmt, base_url, api_key, model, provider, sampling, thinking, reasoning, concurrency,
                          max_attempts, timeout_s, None, tok_sha, Budget(budget_usd), prices)
    limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                         http_client=DefaultAioHttpClient(limits=limits, timeout=timeout_s))
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    async def sample(i: int) -> None:
        try:
            result = await runner._sample(client, rows[i])
        except Exception as exc:  # never leave the parent waiting for an answer that cannot come
            conn.send(("stopped", i, f"worker error: {type(exc).__name__}"))
            return
        conn.send(("stopped", i, runner.stopped) if result is None else ("done", i, *result))

    def on_request() -> None:
        while conn.poll():
            try:
                i = conn.recv()
            except EOFError:
                i = None
            if i is None:
                loop.remove_reader(conn.fileno())
                closed.set()
                return
            t = asyncio.ensure_future(sample(i))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    loop.add_reader(conn.fileno(), on_request)
    try:
        await closed.wait()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await client.close()
