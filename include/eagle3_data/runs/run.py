"""A DAG run's decisions (`Run`) and what every stage shares: refs, the tokenizer, the format.

`resolve_run` is the first thing every task does: it applies the trigger params to the config
(validated like the file), refuses unknown params, and picks the run key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from eagle3_data.config import (
    CONFIG_PARAMS,
    PACKAGED_CONFIGS,
    THRESHOLD_PARAMS,
    PipelineConfig,
    check_run_params,
    load_config,
    resolve_source,
)
from eagle3_data.errors import UserError
from eagle3_data.tokenizer import (
    tokenizer_hashes as tokenizer_hashes,  # (the stages' one spelling of it, here beside the tokenizers)
)

log = logging.getLogger("eagle3_data.pipeline")

NO_DATE = "a run without a logical date reads the newest date partition or undated prompts, and found neither"


@dataclass(frozen=True)
class Run:
    """One DAG run's decisions: everything a stage needs besides the store."""

    config: PipelineConfig
    run_key: str
    date: str | None  # YYYY-MM-DD prompt partition; None for manual runs without a logical date
    datasets: list[str]
    dry_run: bool
    skip_hidden_states: bool
    # stages a person named for replacement (`--fresh`, `fresh_stages`): a committed one that differs
    # from this run is discarded (paid answers archived) instead of refused (runs.reuse.settle)
    fresh: frozenset[str] = frozenset()


def _chosen_config(name: str | None, dag_config: PipelineConfig) -> PipelineConfig:
    """The config a run picked by the trigger param `config`: a packaged one by its family's name
    (`PACKAGED_CONFIGS`), else the DAG's own. The DAG's tasks are one group per dataset of its own
    config, so a chosen config must name the same datasets."""
    if name is None:
        return dag_config
    if name not in PACKAGED_CONFIGS:
        raise UserError(f"params.config: {name!r} is no packaged config (one of {', '.join(PACKAGED_CONFIGS)})")
    chosen = load_config(PACKAGED_CONFIGS[name])
    if chosen.dataset_names != dag_config.dataset_names:
        raise UserError(
            f"params.config: {name!r} names datasets {chosen.dataset_names}, the DAG's config "
            f"{dag_config.dataset_names}: its tasks are the DAG config's datasets"
        )
    return chosen


def resolve_run(
    params: dict[str, Any],
    logical_date: datetime | None,
    config: PipelineConfig | None = None,
    *,
    run_id: str | None = None,
) -> Run:
    """Apply trigger-form params to the config (validated like the file) and pick the run key.

    An unknown param is refused naming it (a mistyped name must not be ignored). Threshold params
    left empty keep the config's per-dataset values; a value set in the form applies to every
    dataset of the run. A run without a logical date or a run_name keys on its `run_id` (and
    reads undated prompt files: `preflight` says so in the first task).
    """
    from eagle3_data.run_key import run_key_for
    from eagle3_data.runs.reuse import check_fresh

    config = config or load_config()
    check_run_params(params)
    config = _chosen_config(params.get("config"), config)
    overrides: dict[str, Any] = {}
    for name, path in CONFIG_PARAMS.items():
        if params.get(name) is None:
            continue
        *parents, leaf = path.split(".")
        node = overrides
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = params[name]
    thresholds = {k: params[k] for k in THRESHOLD_PARAMS if params.get(k) is not None}
    if thresholds:
        overrides["datasets"] = [
            {**item, "validation": {**(item.get("validation") or {}), **thresholds}} for item in config.raw["datasets"]
        ]
    config = config.with_overrides(overrides, where="params") if overrides else config
    datasets = params.get("datasets") or config.dataset_names
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise UserError(f"params.datasets: expected a list of dataset names, got {datasets!r}")
    for name in datasets:
        config.dataset(name)  # UserError naming the unknown dataset
    return Run(
        config=config,
        run_key=run_key_for({"run_name": params.get("run_name")}, logical_date, run_id),
        date=f"{logical_date:%Y-%m-%d}" if logical_date is not None else None,
        datasets=list(dict.fromkeys(datasets)),
        dry_run=bool(params.get("dry_run")),
        skip_hidden_states=bool(params.get("skip_hidden_states")),
        fresh=check_fresh(params.get("fresh_stages") or [], "params.fresh_stages"),
    )


def preflight(run: Run, store) -> None:
    """What the first task checks before anything is read or sent: the bucket exists (creating it
    is a setup step: `eagle3-data s3 init`), and a run without a logical date has undated prompts."""
    store.check_bucket()
    check_prompt_sources(run, store)


def check_prompt_sources(run: Run, store) -> None:
    """A run without a logical date: say now, in the first task, which prompts each dataset's
    load will read (`prompt_date`), or fail naming every dataset that has none, rather than in
    every load_route after the tokenizer audit."""
    if run.date is not None:
        return
    problems = []
    for name in run.datasets:
        try:
            date = prompt_date(run, store, name)
        except UserError as exc:
            problems.append(str(exc))
            continue
        source = run.config.dataset(name).prompts
        log.info(
            "dataset %s: a run without a logical date reads %s",
            name,
            f"the newest date partition of {source}: date={date}" if date else f"the undated prompts of {source}",
        )
    if problems:
        raise UserError("\n".join(problems))


def prompt_date(run: Run, store, dataset: str) -> str | None:
    """The date partition `dataset`'s prompts are read from: the run's logical date. A run without
    one (a manual trigger: the REST API's default `logical_date: null`) reads the dataset's
    undated prompts when its source has them (None: a file, `{root}/{dataset}.jsonl`, ...), else
    the newest `date=YYYY-MM-DD` partition under it, so that triggering a scheduled deployment by
    hand works; with neither, a UserError naming the dataset and where it looked."""
    from eagle3_data.prompt_files import newest_partition, prompt_files

    if run.date is not None:
        return run.date
    source = run.config.dataset(dataset).prompts
    try:
        prompt_files(source, dataset, client=store.client)
        return None
    except UserError as undated:
        newest = newest_partition(source, dataset, client=store.client)
        if newest is None:
            raise UserError(
                f"dataset {dataset}: {NO_DATE} ({source} has no date=YYYY-MM-DD partition for it), "
                f"and no undated prompt file either ({undated})"
            ) from None
        return newest


def open_store(config: PipelineConfig, client) -> Any:
    """The run's ArtifactStore. The bucket is not created here: that is a deliberate setup step
    (`eagle3-data s3 init`); a missing bucket fails with that instruction. Its manifests name the
    config's stand-ins."""
    from eagle3_data.storage import ArtifactStore

    return ArtifactStore(
        client=client, bucket=config.storage.bucket, prefix=config.storage.prefix, stand_ins=config.stand_ins
    )


def stage_ref(run: Run, stage: str, dataset: str):
    from eagle3_data.storage import StageRef

    return StageRef(run.run_key, stage, dataset)


@lru_cache(maxsize=4)
def _load_tokenizer(source: str, s3_client: Any):
    from eagle3_data.tokenizer import load_tokenizer

    return load_tokenizer(resolve_source(source), s3_client=s3_client)


def tokenizer_for(run: Run, store):
    """The run's tokenizer, an s3:// source fetched through the store's client (Airflow:
    aws_default). Cached per source (and client, for s3://): a task's stages share one."""
    source = run.config.tokenizer.source
    return _load_tokenizer(source, store.client if source.startswith("s3://") else None)


@lru_cache(maxsize=4)
def _load_bulk_tokenizer(source: str, s3_client: Any):
    from eagle3_data.tokenizer import load_bulk_tokenizer

    return load_bulk_tokenizer(resolve_source(source), s3_client=s3_client)


def bulk_tokenizer_for(run: Run, store):
    """The run's tokenizer for stages that only encode/decode (reconstruct, validate, merge): the
    verified tiktoken fast path (as the CLI's bulk commands use), no transformers import or
    `tokenizer.json` load, when these exact files were verified on this host before; else the HF
    tokenizer, verifying them for the next start. Same files and template hashes either way."""
    source = run.config.tokenizer.source
    return _load_bulk_tokenizer(source, store.client if source.startswith("s3://") else None)


def output_format(run: Run, store, *, template: bool = True):
    """The model's output format bound to the run's generation mode: the one place that decides
    thinking on/off for rendering, parsing, reconstruction and validation. `template=False`: a
    stage that never renders a prompt (no chat template) takes the bulk tokenizer's fast start."""
    from eagle3_data.chat_format import get_output_format

    tokenizer = tokenizer_for(run, store) if template else bulk_tokenizer_for(run, store)
    return get_output_format(tokenizer, run.config.model.family, thinking=run.config.generation.sampling.thinking)


def sampling(run: Run) -> dict[str, Any]:
    """The sampling params that are part of every sample_id (the later keys only when set away
    from their neutral value: `config.NEUTRAL_SAMPLING`)."""
    from eagle3_data.config import NEUTRAL_SAMPLING

    return {
        k: v
        for k, v in run.config.generation.sampling.model_dump().items()
        if k not in NEUTRAL_SAMPLING or v != NEUTRAL_SAMPLING[k]
    }
