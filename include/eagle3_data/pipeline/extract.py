"""Stage 7, hidden states: the merged shards split over the GPU workers, each worker loading the
target model once for all of its shards (resumable by shard), then one commit of the extraction."""

from __future__ import annotations

from eagle3_data.config import resolve_source
from eagle3_data.pipeline.results import ExtractWorkerResult, ShardResult
from eagle3_data.pipeline.reuse import reusable, same_params
from eagle3_data.pipeline.run import Run, log, stage_ref
from eagle3_data.stages import HIDDEN_STATES, MERGE, RUN_DATASET


def hidden_states_params(run: Run) -> dict:
    """What decides the extracted bytes (recorded in the manifest; the model as configured, not
    where a dev build happens to be cached)."""
    h = run.config.hidden_states
    return {"convention": h.convention, "last_hidden": h.last_hidden, "token_budget": h.batch_tokens, "model": run.config.model.source,
            "backend": h.backend}


def discard_hidden_states(run: Run, store) -> None:
    """Delete the run's hidden states (a new merge or other params make them stale) under the
    stage's lease: StageBusy while a committer or `stage discard` holds it, so no commit lands
    half on the deleted stage. A shard worker still running on the old merge may write its
    summary afterwards: `extracted()` ties a summary to its merged shard's sha256, so that one is
    redone, never committed."""
    out_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET)
    with store.lease(out_ref):
        store.delete(out_ref)


def extract_workers(run: Run, store, shards: list[dict]) -> list[dict]:
    """The merged shards split over `hidden_states.workers` GPU workers, balanced by tokens
    (largest shard first to the least loaded worker; shard order kept within a worker). The DAG
    maps one `extract_hidden_states` task over each: the model is loaded once per worker, not once
    per shard. No shards (hidden states skipped): no worker.

    Hidden states extracted with other params (convention, model, backend) are deleted here, once,
    before the workers start: a worker deleting them could delete a concurrent worker's output."""
    out_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET)
    if shards and store.is_complete(out_ref) and not same_params(store.read_manifest(out_ref), hidden_states_params(run)):
        discard_hidden_states(run, store)  # other convention or model: start over
    n = min(run.config.hidden_states.workers, len(shards))
    loads, assigned = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(shards)), key=lambda i: -int(shards[i].get("tokens") or 0)):
        w = min(range(n), key=lambda k: (loads[k], len(assigned[k]), k))  # no token counts: by shard count
        loads[w] += int(shards[i].get("tokens") or 0)
        assigned[w].append(i)
    return [{"worker": w, "shards": [shards[i] for i in sorted(idx)], "tokens": loads[w]} for w, idx in enumerate(assigned)]


def extract_hidden_states(run: Run, store, work: dict) -> ExtractWorkerResult:
    """One GPU worker's share (`extract_workers`): its shards in turn through ONE backend, loaded
    on the first shard that still needs it; shards an earlier attempt committed are skipped
    (resumable by shard), so a retry after shard k redoes only the rest, and a worker with
    nothing left loads no model at all."""
    import time

    from eagle3_data.hidden_states.engines import shared_backend
    from eagle3_data.hidden_states.extract import extract_shard, extracted, merged_sha256s

    params = hidden_states_params(run)
    out_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET)  # stale params were cleared by extract_workers
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
                # one engine per worker process, kept across its shards (+1: the one generated token)
                backend = shared_backend(params["backend"], model_dir, tensor_parallel_size=h.tensor_parallel_size,
                                         max_model_len=run.config.merge.max_length + 1)
                loads += 1
                log.info("hidden states worker %s: %s backend ready in %.1f s for %d shards",
                         work["worker"], params["backend"], time.perf_counter() - t0, len(work["shards"]))
            summary = extract_shard(
                store, shard, model_dir, out_ref, backend=backend, merged_sha256=shas.get(shard["name"]),
                convention=params["convention"], last_hidden=params["last_hidden"], token_budget=params["token_budget"],
            )
        results.append(ShardResult(shard=shard["name"], samples=summary["samples"], tokens=summary["tokens"],
                                   bytes=summary["bytes"], skipped=bool(summary.get("skipped"))))
    return ExtractWorkerResult(worker=work["worker"], backend_loads=loads, shards=results)


def commit_hidden_states(run: Run, store) -> dict:
    from eagle3_data.hidden_states.extract import commit_extraction

    out_ref, merge_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET), stage_ref(run, MERGE, RUN_DATASET)
    if (manifest := reusable(store, out_ref, [merge_ref], hidden_states_params(run))) is not None:
        return {"uri": store.uri(out_ref), **manifest["extra"]}
    return commit_extraction(store, merge_ref, out_ref, params=hidden_states_params(run))
