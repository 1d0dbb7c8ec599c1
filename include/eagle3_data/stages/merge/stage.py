"""Stage 6, merge: the datasets whose gate passed, shuffled and sharded into training records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from eagle3_data.errors import GateFailed, UserError
from eagle3_data.runs.results import MergeResult
from eagle3_data.runs.reuse import reusable, settle
from eagle3_data.runs.run import Run, output_format, stage_ref
from eagle3_data.runs.upstream import gate_results
from eagle3_data.stages import AUDIT, AUDIT_DATASET, LOCAL, MERGE, OVERFLOW, RECONSTRUCT, RUN_DATASET

if TYPE_CHECKING:
    from eagle3_data.conversations import Folds
    from eagle3_data.storage import ArtifactStore, StageRef


def trajectory_folds_of(run: Run, store: ArtifactStore, datasets: list[str]) -> dict[StageRef, Folds]:
    """The merge's folds per input (conversations.trajectory_folds): the samples the generation
    stages of `datasets` committed when they ran in rounds, against the status of each turn in
    the stage whose rows the merge takes: the overflow stage's samples apply to its reconstruct
    stage, which may find a turn the provider answered unusable (a length cut with tools
    offered), so the fold is decided from the rows the merge reads, not from the generation's.
    Empty for the other modes."""
    from eagle3_data.conversations import SAMPLES_FILE, read_samples, trajectory_folds

    out = {}
    for name in datasets:
        for stage, rows in ((LOCAL, LOCAL), (OVERFLOW, RECONSTRUCT)):
            ref = stage_ref(run, stage, name)
            if not store.is_complete(ref):
                continue
            entry = next((f for f in store.read_manifest(ref)["files"] if f["name"] == SAMPLES_FILE), None)
            if entry is not None:
                with store.open_verified(ref, SAMPLES_FILE, sha256=entry.get("sha256"), nbytes=entry.get("bytes")) as f:
                    samples = read_samples(f.read())
                rows_ref = stage_ref(run, rows, name)
                status = {
                    r["sample_id"]: (r["status"], r["error"])
                    for b in store.iter_batches(rows_ref, columns=["sample_id", "status", "error"])
                    for r in b.to_pylist()
                }
                out[rows_ref] = trajectory_folds(samples, status)
    return out


def merge(run: Run, store: ArtifactStore, failed: Mapping[str, str] | None = None) -> MergeResult:
    """Merge the datasets whose gate passed (`failed`: datasets whose tasks failed in this DAG
    run, left out: `gate_results`); fail when none did. Returns the merged shard refs."""
    from eagle3_data.runs.upstream import merged_shards
    from eagle3_data.stages.merge.datasets import MergeContext, merge_datasets, merge_params

    if not store.is_complete(stage_ref(run, AUDIT, AUDIT_DATASET)):
        raise UserError(f"merge: the tokenizer audit of run {run.run_key} did not pass (see task audit_tokenizer)")
    gates = gate_results(run, store, failed)
    passed = [name for name, g in gates.items() if g.passed]
    if not passed:
        raise GateFailed(
            "merge: no dataset passed its gate: "
            + "; ".join(f"{n}: {', '.join(g.reasons)} ({g.report_uri})" for n, g in gates.items())
        )
    inputs = [ref for name in passed for ref in (stage_ref(run, LOCAL, name), stage_ref(run, RECONSTRUCT, name))]
    params = merge_params(run.config.merge)
    ref = stage_ref(run, MERGE, RUN_DATASET)
    settle(run, store, ref, inputs, params, what="merge")  # refused (nothing written) unless reused or --fresh
    with store.lease(ref) as held:  # one merge per run key: a second (zombie, manual rerun) gets StageBusy
        if (manifest := reusable(store, ref, inputs, params)) is None:
            summary = merge_datasets(
                store,
                inputs,
                run.run_key,
                run.config.merge,
                out_dataset=RUN_DATASET,
                vocab_size=output_format(run, store, template=False).vocab_size,
                context=MergeContext(folds=trajectory_folds_of(run, store, passed), lease=held),
            )
            shards, totals = summary["shards"], summary["totals"]
        else:
            shards, totals = merged_shards(store, ref, manifest), manifest["extra"]["totals"]
    return MergeResult(uri=store.uri(ref), datasets=passed, shards=shards, totals=totals)
