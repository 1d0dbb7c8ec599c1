"""Stage 3, generation: local (SGLang, exact ids) and overflow (OpenRouter, text only), both from
the routed prompts, so the DAG runs them side by side. Paid work is never repeated: a complete
stage made from the same prompts with the same generation settings is reused, and an interrupted
one resumes by sample id. A complete stage whose answers were made from other prompts, tokenizer
or settings (model, engine, provider, sampling) is refused, never reused as this config's answers
and never discarded: a person chooses (`--fresh`, which archives the answers: `reuse.settle`).

The library receives plain values (endpoint URLs, base URL, API key); reading them from Airflow
connections is the hooks' job (plugins/hooks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from eagle3_data.errors import StageStopped, UserError
from eagle3_data.runs.results import GenerationResult
from eagle3_data.runs.reuse import reopen, settle
from eagle3_data.runs.run import Run, log, output_format, stage_ref
from eagle3_data.stages import LOCAL, OVERFLOW, PROMPTS

if TYPE_CHECKING:
    from eagle3_data.chat_format.base import OutputFormat
    from eagle3_data.stages.generate.checkpoint import StageSetup
    from eagle3_data.stages.generate.contracts import StageSummary
    from eagle3_data.storage.refs import StageRef
    from eagle3_data.storage.store import ArtifactStore


def _prompt_rows(store: ArtifactStore, ref: StageRef) -> Iterator[dict[str, Any]]:
    """The prompts stage's rows, a batch at a time: the generation client validates and spills
    them in one pass, so no list of every prompt is ever built."""
    for batch in store.iter_batches(ref):
        yield from batch.to_pylist()


def _reused(
    run: Run,
    store: ArtifactStore,
    ref: StageRef,
    prompts: StageRef,
    settings: dict[str, Any],
    fmt: OutputFormat,
    what: str,
) -> GenerationResult | None:
    """The complete stage made from these prompts, with this tokenizer and this run's generation
    `settings` (a subset of the stage's params, `_other_settings`); None when there is none, or
    when the run named the stage in `fresh` and it was replaced (its answers archived). A complete
    stage made from anything else is refused (`reuse.settle`): its answers were paid for, and the
    config may be the mistake."""
    from eagle3_data.tokenizer import tokenizer_hashes

    manifest = settle(
        run,
        store,
        ref,
        [prompts],
        None,
        what=what,
        hashes=tokenizer_hashes(fmt.tokenizer),
        compare=lambda m: _other_settings(m.get("params") or {}, settings),
    )
    if manifest is None:
        return None
    return GenerationResult(uri=store.uri(ref), rows=manifest["rows"], reused=True)


# params the writer adds from the output format, not from the generation config: left out of the
# comparison (the tokenizer and template have their own hashes in the manifest)
_FORMAT_KEYS = ("thinking", "stop_token_ids")


def _other_settings(committed: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """Each setting of `settings` the committed answers were generated with otherwise (the
    sampling without what the output format adds), as phrases. Reusing them would hand another
    model's or another sampler's answers downstream as this config's: the silent error the product
    exists to prevent."""
    from eagle3_data.canonical import canonical_json

    def comparable(key: str, value: Any) -> Any:
        if key == "sampling" and isinstance(value, dict):
            return {k: v for k, v in value.items() if k not in _FORMAT_KEYS}
        return value

    return [
        f"{key} {canonical_json(comparable(key, committed.get(key)))} (committed) vs "
        f"{canonical_json(comparable(key, value))} (this run)"
        for key, value in settings.items()
        if canonical_json(comparable(key, committed.get(key))) != canonical_json(comparable(key, value))
    ]


def _finished(result: StageSummary, what: str, store: ArtifactStore, ref: StageRef) -> GenerationResult:
    """A stage that stopped early (endpoints down, budget, retryable failures) raises, so Airflow
    retries it; committed rows are kept and skipped by the next attempt. A complete one reports
    its rows as its manifest counts them (what the next stage reads), as a reused one does."""
    if result["stopped_reason"] or not result["complete"]:
        detail = f" ({result['stop_detail']})" if result["stop_detail"] else ""
        raise StageStopped(
            f"{what} stopped before completion: {result['stopped_reason']}{detail}; counts "
            f"{result['counts']}; committed rows are kept and the next attempt resumes after them"
        )
    return GenerationResult(
        uri=result["uri"],
        counts=result["counts"],
        rows=store.read_manifest(ref)["rows"],
        tokens=result["tokens"],
        cost_usd=result["cost_usd"],
    )


def generate_local(
    run: Run,
    store: ArtifactStore,
    dataset: str,
    endpoints: list[str],
    api_key: str | None = None,
    *,
    rerun: bool = False,
) -> GenerationResult:
    """The samples routed local|both on the local engine's `endpoints` (http(s) URLs), sending
    `api_key` (theirs, from `--api-key`; never logged) on every request when given."""
    from eagle3_data.engines import wire_for
    from eagle3_data.stages.generate.local import generate_local as generate

    prompts, ref = stage_ref(run, PROMPTS, dataset), stage_ref(run, LOCAL, dataset)
    g = run.config.generation
    wire = wire_for(g.local.engine, api_key)
    settings = {"source": wire.source, "model": run.config.model.name, "sampling": wire.sampling(engine_sampling(run))}
    what = f"generate_local {dataset}"
    fmt = output_format(run, store)
    if not rerun and (reused := _reused(run, store, ref, prompts, settings, fmt, what)) is not None:
        return reused
    if not endpoints:
        raise UserError(f"{what}: no local endpoints configured")
    if rerun:
        reopen(run, store, ref, f"{what}: reopened by --rerun")
    result = generate(
        store,
        ref,
        _prompt_rows(store, prompts),
        fmt,
        endpoints,
        engine_sampling(run),
        wire=wire,
        config=g.local,
        setup=_setup(run, prompts, ref.stage, rerun, fmt),
    )
    return _finished(result, f"generate_local {dataset}", store, ref)


def generate_overflow(
    run: Run, store: ArtifactStore, dataset: str, base_url: str, api_key: str, *, rerun: bool = False
) -> GenerationResult:
    """The samples routed overflow|both through OpenRouter at `base_url` with `api_key` (never logged)."""
    from eagle3_data.stages.generate.contracts import StopReason
    from eagle3_data.stages.generate.openrouter import check_sampling
    from eagle3_data.stages.generate.openrouter import generate_overflow as generate

    prompts, ref = stage_ref(run, PROMPTS, dataset), stage_ref(run, OVERFLOW, dataset)
    o = run.config.generation.overflow
    settings = {"model": o.model, "provider": dict(o.provider), "sampling": check_sampling(engine_sampling(run))}
    what = f"generate_overflow {dataset}"
    fmt = output_format(run, store)
    if not rerun and (reused := _reused(run, store, ref, prompts, settings, fmt, what)) is not None:
        return reused
    if rerun:
        reopen(run, store, ref, f"{what}: reopened by --rerun")
    result = generate(
        store,
        ref,
        _prompt_rows(store, prompts),
        fmt,
        base_url,
        api_key,
        engine_sampling(run),
        config=o,
        setup=_setup(run, prompts, ref.stage, rerun, fmt),
    )
    if (stopped := result["stopped_reason"]) is not None and not StopReason(stopped).passes:
        detail = f": {result['stop_detail']}" if result["stop_detail"] else ""
        raise UserError(  # the account or the config: a person must act before a retry can pass
            f"generate_overflow {dataset} stopped: {result['stopped_reason']}{detail} (spent "
            f"${result['cost_usd']:.4f}, max_usd {o.max_usd}); committed rows are kept and skipped on rerun"
        )
    return _finished(result, f"generate_overflow {dataset}", store, ref)


def engine_sampling(run: Run) -> dict[str, Any]:
    """The sampling params an engine receives: every key of the config's, neutral ones included
    (an engine fills an unset key its own way; an unset seed is unset on every engine), the
    generation mode aside (it is bound into the output format, `pipeline.output_format`)."""
    return {k: v for k, v in run.config.generation.sampling.model_dump().items() if k != "thinking" and v is not None}


def _setup(run: Run, prompts: StageRef, stage: str, rerun: bool, fmt: OutputFormat) -> StageSetup:
    """What both stages record; a turn driver when the turns of a conversation depend on each
    other (conversations: the stage runs in rounds)."""
    from eagle3_data.conversations import TurnDriver, needs_rounds
    from eagle3_data.stages.generate.checkpoint import StageSetup
    from eagle3_data.stages.generate.progress import LogProgress

    g = run.config.generation
    turns = (
        TurnDriver(g.regenerate, g.history, fmt, max_steps=g.max_trajectory_steps)
        if needs_rounds(g.regenerate, g.history)
        else None
    )
    return StageSetup(
        model=run.config.model.name,
        inputs=(prompts,),
        progress=LogProgress(log),
        rerun=rerun,
        fresh=stage in run.fresh,
        turns=turns,
    )
