"""Stage 7, hidden states: the merged shards split over the GPU workers, each worker loading the
target model once for all of its shards (resumable by shard), then one commit of the extraction."""

from __future__ import annotations

from typing import Any

from eagle3_data.config import resolve_source
from eagle3_data.extraction_params import hidden_states_params
from eagle3_data.runs.results import ExtractWorkerResult, ShardResult
from eagle3_data.runs.reuse import reusable, settle
from eagle3_data.runs.run import Run, log, stage_ref
from eagle3_data.stages import HIDDEN_STATES, MERGE, RUN_DATASET
from eagle3_data.storage_estimate import describe, storage_estimate


def discard_stale_hidden_states(run: Run, store) -> bool:
    """The one place that deletes the run's hidden states: committed ones extracted with other
    params (convention, model, backend, storage) or from another merge than the committed one only
    when the run names the stage in `fresh` (else a StageConflict: `reuse.settle`), an unfinished
    extraction of another merge always. Under the stage's lease: StageBusy while a committer or
    `stage discard` holds it, so no commit lands half on the deleted stage. Called by the plan,
    before any worker starts (a worker deleting them could delete a concurrent worker's output).
    A shard worker still running on an old merge may write its summary afterwards: `extracted()`
    ties a summary to its merged shard's sha256, so that one is redone, never committed.
    True when something was deleted."""
    out_ref, merge_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET), stage_ref(run, MERGE, RUN_DATASET)
    if not store.objects(out_ref):
        return False
    if store.is_complete(out_ref):  # committed: reused, refused, or replaced when the run names it in fresh
        return settle(run, store, out_ref, [merge_ref], hidden_states_params(run), what="hidden states") is None
    if not _summaries_of_another_merge(store, out_ref, merge_ref):
        return False  # an unfinished extraction of this merge: the workers resume it
    with store.lease(out_ref):
        store.delete(out_ref)
    log.info("discarded the stale hidden states %s (other params or another merge)", store.uri(out_ref))
    return True


def _summaries_of_another_merge(store, out_ref, merge_ref) -> bool:
    from eagle3_data.stages import SUMMARY_SUFFIX
    from eagle3_data.stages.hidden_states.extract import merged_sha256s

    current = set(merged_sha256s(store.read_manifest(merge_ref)).values())
    for name in store.committed_files(out_ref):
        if name.endswith(SUMMARY_SUFFIX):
            sha = (store.get_json(out_ref, name).get("merged_shard") or {}).get("sha256")
            if sha not in current:
                return True
    return False


def plan_hidden_states(run: Run, store) -> list[dict[str, Any]]:
    """Which merged shards go to which GPU worker: `hidden_states.workers` shares balanced by tokens
    (largest shard first to the least loaded worker; shard order kept within a worker). The DAG
    maps one `extract_hidden_states` task over each: the model is loaded once per worker, not once
    per shard. Stale states are discarded first (`discard_stale_hidden_states`); no merge, or
    hidden states skipped: no worker."""
    from eagle3_data.runs.upstream import merged_shards

    merge_ref = stage_ref(run, MERGE, RUN_DATASET)
    if run.dry_run or run.skip_hidden_states or not store.is_complete(merge_ref):
        return []
    discard_stale_hidden_states(run, store)
    shards = merged_shards(store, merge_ref)
    est = storage_estimate(run, sum(int(s.get("tokens") or 0) for s in shards))
    if est is not None:
        log.info("hidden states will take about: %s", describe(est))
    return split_shards(shards, run.config.hidden_states.workers)


def split_shards(shards: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """`shards` over `workers` workers, balanced by tokens (see `plan_hidden_states`)."""
    n = min(workers, len(shards))
    loads = [0] * n
    assigned: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(shards)), key=lambda i: -int(shards[i].get("tokens") or 0)):
        w = min(range(n), key=lambda k: (loads[k], len(assigned[k]), k))  # no token counts: by shard count
        loads[w] += int(shards[i].get("tokens") or 0)
        assigned[w].append(i)
    return [
        {"worker": w, "shards": [shards[i] for i in sorted(idx)], "tokens": loads[w]} for w, idx in enumerate(assigned)
    ]


def extract_hidden_states(run: Run, store, work: dict[str, Any]) -> ExtractWorkerResult:
    """One GPU worker's share (`extract_workers`): its shards in turn through ONE backend, loaded
    on the first shard that still needs it; shards an earlier attempt committed are skipped
    (resumable by shard), so a retry after shard k redoes only the rest, and a worker with
    nothing left loads no model at all."""
    import time

    from eagle3_data.images import read_merged_images
    from eagle3_data.stages.hidden_states.engines import shared_backend
    from eagle3_data.stages.hidden_states.extract import extract_shard, extracted, merged_sha256s

    params = hidden_states_params(run)
    out_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET)  # stale states were discarded by the plan
    model_dir = resolve_source(run.config.model.source)
    h = run.config.hidden_states
    shas = merged_sha256s(store.read_manifest(stage_ref(run, MERGE, RUN_DATASET)))
    committed = store.committed_files(out_ref)  # one listing: shards done before this worker started
    backend, loads, results = None, 0, []
    for shard in work["shards"]:
        if (done := extracted(store, out_ref, shard, shas.get(shard["name"]), committed)) is not None:
            summary = {**done, "skipped": True}
        else:
            if backend is None:
                t0 = time.perf_counter()
                image_refs = read_merged_images(store, stage_ref(run, MERGE, RUN_DATASET))  # once, for every shard
                # one engine per worker process, kept across its shards (+1: the one generated token)
                backend = shared_backend(
                    params["backend"],
                    model_dir,
                    tensor_parallel_size=h.tensor_parallel_size,
                    max_model_len=run.config.merge.max_length + 1,
                    max_images=h.max_images,
                )
                loads += 1
                log.info(
                    "hidden states worker %s: %s backend ready in %.1f s for %d shards",
                    work["worker"],
                    params["backend"],
                    time.perf_counter() - t0,
                    len(work["shards"]),
                )
            summary = extract_shard(
                store,
                shard,
                model_dir,
                out_ref,
                h,
                backend=backend,
                merged_sha256=shas.get(shard["name"]),
                image_refs=image_refs,
            )
        results.append(
            ShardResult(
                shard=shard["name"],
                samples=summary["samples"],
                tokens=summary["tokens"],
                bytes=summary["bytes"],
                skipped=bool(summary.get("skipped")),
            )
        )
    return ExtractWorkerResult(worker=work["worker"], backend_loads=loads, shards=results)


def commit_hidden_states(run: Run, store) -> dict[str, Any]:
    """The hidden-states stage's manifest, once every merged shard's summary is in (its own DAG
    task, after the workers): IncompleteStage naming the shards missing otherwise."""
    from eagle3_data.stages.hidden_states.extract import commit_extraction

    out_ref, merge_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET), stage_ref(run, MERGE, RUN_DATASET)
    if (manifest := reusable(store, out_ref, [merge_ref], hidden_states_params(run))) is not None:
        return {"uri": store.uri(out_ref), **manifest["extra"]}
    return commit_extraction(store, merge_ref, out_ref, params=hidden_states_params(run))
