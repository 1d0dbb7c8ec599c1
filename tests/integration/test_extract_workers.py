"""The hidden-states stage as the DAG runs it: the merged shards split over
`hidden_states.workers` GPU workers, each loading the model ONCE for all of its shards, resumable
by shard. Model loads per run = number of workers, not number of shards."""

from __future__ import annotations

import pytest

from eagle3_data.config import load_config
from eagle3_data.stages.hidden_states import backends, engines
from eagle3_data.stages.hidden_states.stage import split_shards
from eagle3_data.storage import StageRef
from tests.fixtures.kimi import VOCAB_SIZE
from tests.integration.test_extract_s3 import RUN, generations  # noqa: F401  (fixture)


@pytest.fixture
def counted_loads(monkeypatch):
    """Every model load, counted; each worker call starts with an empty engine cache, as a fresh
    Airflow task process does."""
    loads = []

    class Counted(backends.TransformersBackend):
        def __init__(self, *a, **kw):
            loads.append(a[0])
            super().__init__(*a, **kw)

    monkeypatch.setattr(engines, "TransformersBackend", Counted)
    return loads


def _run(tiny_kimi_k25_dir, workers):
    from eagle3_data.runs.run import Run

    config = load_config().with_overrides(
        {
            "model": {"source": str(tiny_kimi_k25_dir)},
            "hidden_states": {"workers": workers},
            "merge": {"max_length": 40},
        },
        where="test",
    )
    return Run(
        config=config, run_key=RUN, date=None, datasets=config.dataset_names, dry_run=False, skip_hidden_states=False
    )


def test_one_model_load_per_gpu_worker_resumable_by_shard(
    store,
    generations,
    tiny_kimi_k25_dir,
    counted_loads,
    monkeypatch,
):
    from eagle3_data import pipeline
    from eagle3_data.config import MergeConfig
    from eagle3_data.stages.hidden_states import extract as extract_mod
    from eagle3_data.stages.merge.datasets import merge_datasets

    run = _run(tiny_kimi_k25_dir, workers=2)
    shards = merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=100, max_length=40), vocab_size=VOCAB_SIZE
    )["shards"]
    assert len(shards) >= 4
    work = split_shards(shards, run.config.hidden_states.workers)
    assert len(work) == 2
    assert sorted(s["name"] for w in work for s in w["shards"]) == sorted(s["name"] for s in shards)  # each once
    assert abs(work[0]["tokens"] - work[1]["tokens"]) <= max(s["tokens"] for s in shards)  # balanced by tokens
    assert all(len(w["shards"]) >= 2 for w in work)

    # worker 0's first attempt dies after its first shard (a preempted GPU node)
    real = extract_mod.extract_shard
    calls = []

    def dies_on_second(*a, **kw):
        calls.append(a[1]["name"])
        if len(calls) == 2:
            raise RuntimeError("node lost")
        return real(*a, **kw)

    monkeypatch.setattr(extract_mod, "extract_shard", dies_on_second)
    monkeypatch.setattr(engines, "_SHARED", {})
    with pytest.raises(RuntimeError, match="node lost"):
        pipeline.extract_hidden_states(run, store, work[0])
    monkeypatch.setattr(extract_mod, "extract_shard", real)
    assert len(counted_loads) == 1

    results = []
    for w in work:  # the retry of worker 0, then worker 1: each a fresh process
        monkeypatch.setattr(engines, "_SHARED", {})
        results.append(pipeline.extract_hidden_states(run, store, w))
    retry, other = results
    assert [s.skipped for s in retry.shards] == [True] + [False] * (len(retry.shards) - 1)  # resumed by shard
    assert not any(s.skipped for s in other.shards)
    assert (retry.backend_loads, other.backend_loads) == (1, 1)
    assert len(counted_loads) == 3  # 2 workers, 1 retry: never one load per shard
    hidden = pipeline.commit_hidden_states(run, store)
    assert hidden["totals"]["samples"] == 20

    # a rerun with everything committed loads no model at all
    monkeypatch.setattr(engines, "_SHARED", {})
    assert pipeline.extract_hidden_states(run, store, work[1]).backend_loads == 0
    assert len(counted_loads) == 3


def test_workers_beyond_the_shards_get_none(tiny_kimi_k25_dir, store):
    from eagle3_data import pipeline

    run = _run(tiny_kimi_k25_dir, workers=8)
    shards = [{"name": f"shard-{i:05d}.parquet", "tokens": t} for i, t in enumerate([5, 50, 7])]
    work = split_shards(shards, run.config.hidden_states.workers)
    assert [len(w["shards"]) for w in work] == [1, 1, 1]
    assert split_shards([], 8) == []
    assert pipeline.plan_hidden_states(run, store) == []  # no merge committed: no worker
    untokened = split_shards([{"name": f"s{i}"} for i in range(5)], 2)
    assert [len(w["shards"]) for w in untokened] == [3, 2]  # no token counts: spread by shard count
    one = split_shards(shards, 1)
    assert [s["name"] for s in one[0]["shards"]] == [s["name"] for s in shards]  # merge order kept


def test_stale_hidden_states_are_refused_then_replaced_on_purpose_under_their_lease(
    store,
    generations,
    tiny_kimi_k25_dir,
):
    """Committed hidden states of other params or of another merge are never deleted silently:
    the plan refuses them (StageConflict naming `--fresh hidden_states`), and a run that names the
    stage in `fresh` discards them (in the plan, before any worker), but not under a committer (or
    `stage discard`) that holds the stage's lease: StageBusy, and the stage stays as it was.
    States of this merge with these params are kept."""
    import dataclasses

    from eagle3_data import pipeline
    from eagle3_data.config import MergeConfig
    from eagle3_data.errors import StageConflict
    from eagle3_data.stages.hidden_states.extract import commit_extraction, extract_shard
    from eagle3_data.stages.merge.datasets import merge_datasets
    from eagle3_data.storage import StageBusy

    run = _run(tiny_kimi_k25_dir, workers=1)
    fresh = dataclasses.replace(run, fresh=frozenset({"hidden_states"}))
    merge_ref, out_ref = StageRef(RUN, "merge", "all"), StageRef(RUN, "hidden_states", "all")  # the pipeline's stages
    for shard in merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=400, max_length=40), vocab_size=VOCAB_SIZE
    )["shards"]:
        extract_shard(store, shard, tiny_kimi_k25_dir, out_ref)
    commit_extraction(store, merge_ref, out_ref)  # committed without the run's params: stale
    with pytest.raises(StageConflict, match="--fresh hidden_states"):
        pipeline.discard_stale_hidden_states(run, store)
    store.verify(out_ref)
    with store.lease(out_ref):
        with pytest.raises(StageBusy, match="is being written by"):
            pipeline.discard_stale_hidden_states(fresh, store)
    store.verify(out_ref)
    assert pipeline.discard_stale_hidden_states(fresh, store)
    assert not store.is_complete(out_ref) and not store.committed_files(out_ref)
    work = pipeline.plan_hidden_states(run, store)  # the run's own extraction: kept
    for w in work:
        pipeline.extract_hidden_states(run, store, w)
    pipeline.commit_hidden_states(run, store)
    assert not pipeline.discard_stale_hidden_states(fresh, store) and store.is_complete(out_ref)
    merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=300, max_length=40), vocab_size=VOCAB_SIZE
    )  # a new merge: stale again
    with pytest.raises(StageConflict, match="its inputs were other commits"):
        pipeline.discard_stale_hidden_states(run, store)
    assert pipeline.discard_stale_hidden_states(fresh, store) and not store.is_complete(out_ref)
