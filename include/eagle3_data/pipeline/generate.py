"""Stage 3, generation: local (SGLang, exact ids) and overflow (OpenRouter, text only), both from
the routed prompts, so the DAG runs them side by side. Paid work is never repeated: a complete
stage made from the same prompts is reused, and an interrupted one resumes by sample id.

The library receives plain values (endpoint URLs, base URL, API key); reading them from Airflow
connections is the hooks' job (plugins/hooks).
"""

from __future__ import annotations

from collections.abc import Iterator

from eagle3_data.errors import UserError
from eagle3_data.pipeline.results import GenerationResult
from eagle3_data.pipeline.reuse import reusable
from eagle3_data.pipeline.run import Run, log, sampling, stage_ref, tokenizer_for
from eagle3_data.stages import LOCAL, OVERFLOW, PROMPTS


def _prompt_rows(store, ref) -> Iterator[dict]:
    """The prompts stage's rows, a batch at a time: the generation client validates and spills
    them in one pass, so no list of every prompt is ever built."""
    for batch in store.iter_batches(ref):
        yield from batch.to_pylist()


def _reused(store, ref, prompts) -> GenerationResult | None:
    manifest = reusable(store, ref, [prompts], invalidate=True)
    return None if manifest is None else GenerationResult(uri=store.uri(ref), rows=manifest["rows"], reused=True)


def _finished(result: dict, what: str) -> GenerationResult:
    """A stage that stopped early (endpoints down, budget, retryable failures) raises, so Airflow
    retries it; committed rows are kept and skipped by the next attempt."""
    if result.get("stopped_reason") or not result.get("complete", True):
        raise RuntimeError(f"{what} stopped before completion: {result.get('stopped_reason')}; counts {result.get('counts')}")
    return GenerationResult(uri=result["uri"], counts=result.get("counts") or {}, tokens=result.get("tokens"),
                            cost_usd=result.get("cost_usd"))


def generate_local(run: Run, store, dataset: str, endpoints: list[str]) -> GenerationResult:
    """The samples routed local|both on the local engine's `endpoints` (http(s) URLs)."""
    from eagle3_data.generation.progress import LogProgress

    if run.config.generation.local.engine == "vllm":
        from eagle3_data.generation.vllm import generate_local as generate
    else:
        from eagle3_data.generation.sglang import generate_local as generate

    prompts, ref = stage_ref(run, PROMPTS, dataset), stage_ref(run, LOCAL, dataset)
    if (reused := _reused(store, ref, prompts)) is not None:
        return reused
    if not endpoints:
        raise UserError(f"generate_local {dataset}: no local endpoints configured")
    g = run.config.generation
    result = generate(
        store, ref, _prompt_rows(store, prompts), tokenizer_for(run, store), endpoints, sampling(run),
        in_flight_per_endpoint=g.local.in_flight_per_endpoint, rows_per_part=g.local.rows_per_part,
        model=run.config.model.name, inputs=[prompts], progress=LogProgress(log),
        warmup_timeout_s=g.local.warmup_timeout_s, max_endpoint_failures=g.local.max_endpoint_failures,
        unreachable_timeout_s=g.local.unreachable_timeout_s, connect_timeout_s=g.local.connect_timeout_s,
    )
    return _finished(result, f"generate_local {dataset}")


def generate_overflow(run: Run, store, dataset: str, base_url: str, api_key: str) -> GenerationResult:
    """The samples routed overflow|both through OpenRouter at `base_url` with `api_key` (never logged)."""
    from eagle3_data.generation.openrouter import UNPRICED
    from eagle3_data.generation.openrouter import generate_overflow as generate
    from eagle3_data.generation.progress import LogProgress

    prompts, ref = stage_ref(run, PROMPTS, dataset), stage_ref(run, OVERFLOW, dataset)
    if (reused := _reused(store, ref, prompts)) is not None:
        return reused
    o = run.config.generation.overflow
    result = generate(
        store, ref, _prompt_rows(store, prompts), tokenizer_for(run, store), base_url,
        api_key, o.model, o.provider, o.max_usd, sampling=sampling(run),
        concurrency=o.concurrency, rows_per_part=o.rows_per_part, inputs=[prompts], progress=LogProgress(log),
        price_usd_per_mtok=o.price_usd_per_mtok.model_dump(),
        unreachable_timeout_s=o.unreachable_timeout_s, connect_timeout_s=o.connect_timeout_s,
    )
    if result.get("stopped_reason") in ("budget", "credits", "unauthorized", UNPRICED):
        raise UserError(
            f"generate_overflow {dataset} stopped: {result['stopped_reason']} (spent ${result.get('cost_usd', 0):.4f} "
            f"of max_usd {o.max_usd}); committed rows are kept and skipped on rerun"
        )
    return _finished(result, f"generate_overflow {dataset}")
