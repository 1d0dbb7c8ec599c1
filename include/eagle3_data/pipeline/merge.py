"""Stage 6, merge: the datasets whose gate passed, shuffled and sharded into training records."""

from __future__ import annotations

from eagle3_data.errors import GateFailed
from eagle3_data.pipeline.results import MergeResult
from eagle3_data.pipeline.reuse import reusable
from eagle3_data.pipeline.run import Run, output_format, stage_ref
from eagle3_data.pipeline.validate import gate_results
from eagle3_data.stages import AUDIT, AUDIT_DATASET, LOCAL, MERGE, RECONSTRUCT, RUN_DATASET


def merge(run: Run, store) -> MergeResult:
    """Merge the datasets whose gate passed; fail when none did. Returns the merged shard refs."""
    from eagle3_data.merge import merge_datasets, merged_shards

    if not store.is_complete(stage_ref(run, AUDIT, AUDIT_DATASET)):
        raise GateFailed(f"merge: the tokenizer audit of run {run.run_key} did not pass (see task audit_tokenizer)")
    gates = gate_results(run, store)
    passed = [name for name, g in gates.items() if g.passed]
    if not passed:
        raise GateFailed(
            "merge: no dataset passed its gate: "
            + "; ".join(f"{n}: {', '.join(g.reasons)} ({g.report_uri})" for n, g in gates.items())
        )
    inputs = [ref for name in passed for ref in (stage_ref(run, LOCAL, name), stage_ref(run, RECONSTRUCT, name))]
    params = run.config.merge.model_dump()
    ref = stage_ref(run, MERGE, RUN_DATASET)
    with store.lease(ref) as held:  # one merge per run key: a second (zombie, manual rerun) gets StageBusy
        if (manifest := reusable(store, ref, inputs, params)) is None:  # its hidden states are stale: the plan discards them
            summary = merge_datasets(store, inputs, run.run_key, **params, out_dataset=RUN_DATASET,
                                     vocab_size=output_format(run, store, template=False).vocab_size, lease=held)
            shards, totals = summary["shards"], summary["totals"]
        else:
            shards, totals = merged_shards(store, ref, manifest), manifest["extra"]["totals"]
    return MergeResult(uri=store.uri(ref), datasets=passed, shards=shards, totals=totals)
