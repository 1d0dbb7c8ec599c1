"""One writer per stage for the file stages (issue 13): merge and hidden-state extraction, on the
real SeaweedFS. A first writer is held mid-stage (an Event inside its work, no timing), a second
writer of the same stage (or shard) must fail at once with StageBusy naming the holder, and the
first one must then finish and verify."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eagle3_data.cli import main
from eagle3_data.config import MergeConfig
from eagle3_data.stages.hidden_states import extract as extract_mod
from eagle3_data.stages.hidden_states.extract import commit_extraction, extract_shard
from eagle3_data.stages.merge import datasets as merge_mod
from eagle3_data.stages.merge.datasets import merge_datasets
from eagle3_data.storage import StageBusy, StageRef
from tests.fixtures.kimi import VOCAB_SIZE
from tests.integration.test_extract_s3 import RUN, generations, s3_env  # noqa: F401  (fixtures)

MERGE_REF = StageRef(RUN, "merge", "all")
OUT_REF = StageRef(RUN, "extract_hidden_states", "all")


def _paused(monkeypatch, module, name, when=lambda *a, **kw: True):
    """Make `module.name` stop inside its first matching call until `go` is set; `inside` says it got there."""
    real, inside, go = getattr(module, name), threading.Event(), threading.Event()

    def wrapper(*a, **kw):
        if when(*a, **kw) and not inside.is_set():
            inside.set()
            assert go.wait(120), "the test never let the first writer go on"
        return real(*a, **kw)

    monkeypatch.setattr(module, name, wrapper)
    return inside, go


def test_second_merge_of_one_run_key_fails_fast(store, generations, s3_env, monkeypatch, capsys):
    inside, go = _paused(monkeypatch, merge_mod, "_merge_bucket")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            merge_datasets, store, generations, RUN, MergeConfig(shard_tokens=150, max_length=40), vocab_size=VOCAB_SIZE
        )
        assert inside.wait(120)
        try:
            with pytest.raises(StageBusy, match=r"merge/all/ is being written by .*expires"):
                merge_datasets(
                    store, generations, RUN, MergeConfig(shard_tokens=150, max_length=40), vocab_size=VOCAB_SIZE
                )
            capsys.readouterr()
            argv = [
                "merge",
                *[arg for r in generations for arg in ("--input", store.uri(r))],
                "--out-run-key",
                RUN,
                "--shard-tokens",
                "150",
                "--max-length",
                "40",
            ]
            assert main(argv) == 2  # the CLI: exit 2, one line naming the holder
            err = capsys.readouterr().err.strip().splitlines()
            assert "is being written by" in err[-1] and "Traceback" not in "\n".join(err)
        finally:
            go.set()
        summary = first.result()
    store.verify(MERGE_REF)
    assert store.read_manifest(MERGE_REF)["extra"]["shards"] == summary["shards"]
    assert (
        merge_datasets(store, generations, RUN, MergeConfig(shard_tokens=150, max_length=40), vocab_size=VOCAB_SIZE)[
            "shards"
        ]
        == summary["shards"]
    )


def test_extraction_leases_shards_not_the_stage(store, generations, tiny_model_dir, monkeypatch):
    """Two GPU workers on different shards of one stage run side by side; a second writer of the
    shard a worker is extracting is refused; the commit waits for no lease of a finished shard."""
    shards = merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=150, max_length=40), vocab_size=VOCAB_SIZE
    )["shards"]
    assert len(shards) >= 2
    held, other = shards[0], shards[1]
    inside, go = _paused(
        monkeypatch,
        extract_mod,
        "extract_rows",
        when=lambda _b, _r, _o, stem, *a, **kw: stem == Path(held["name"]).stem,
    )
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(extract_shard, store, held, tiny_model_dir, OUT_REF)
        assert inside.wait(120)
        try:
            with pytest.raises(StageBusy, match=rf"\(shard {Path(held['name']).stem}\) is being written by"):
                extract_shard(store, held, tiny_model_dir, OUT_REF)
            parallel = extract_shard(store, other, tiny_model_dir, OUT_REF)  # another worker's shard: not blocked
            assert parallel["samples"] == other["samples"] and not parallel.get("skipped")
        finally:
            go.set()
        done = first.result()
    assert done["samples"] == held["samples"] and not done.get("skipped")
    for shard in shards[2:]:
        extract_shard(store, shard, tiny_model_dir, OUT_REF)
    result = commit_extraction(store, MERGE_REF, OUT_REF)
    assert result["totals"]["samples"] == sum(s["samples"] for s in shards)
    store.verify(OUT_REF)


def test_second_committer_of_an_extraction_fails_fast(store, generations, tiny_model_dir):
    shards = merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=400, max_length=40), vocab_size=VOCAB_SIZE
    )["shards"]
    for shard in shards:
        extract_shard(store, shard, tiny_model_dir, OUT_REF)
    with store.lease(OUT_REF):  # a committer (or `stage discard`) holds the stage
        with pytest.raises(StageBusy, match=r"extract_hidden_states/all/ is being written by"):
            commit_extraction(store, MERGE_REF, OUT_REF)
    assert not store.is_complete(OUT_REF)
    commit_extraction(store, MERGE_REF, OUT_REF)
    store.verify(OUT_REF)


def test_a_shard_extracted_from_an_earlier_merge_is_redone_not_committed(store, generations, tiny_model_dir):
    """A re-merge writes other bytes under the same shard names. A worker still extracting the
    old merge (a zombie; its lease is per shard) can put its summary in place after the re-merge
    discarded the stage: that summary is neither skipped on resume nor committed, since its
    states belong to other token ids."""
    from eagle3_data.stages.hidden_states.extract import merged_sha256s
    from eagle3_data.storage import IncompleteStage

    old = merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=400, max_length=40, seed=1), vocab_size=VOCAB_SIZE
    )["shards"]
    zombie = extract_shard(store, old[0], tiny_model_dir, OUT_REF)
    new = merge_datasets(
        store, generations, RUN, MergeConfig(shard_tokens=400, max_length=40, seed=2), vocab_size=VOCAB_SIZE
    )["shards"]
    sha = merged_sha256s(store.read_manifest(MERGE_REF))[new[0]["name"]]
    assert new[0]["name"] == old[0]["name"] and zombie["merged_shard"]["sha256"] != sha
    for shard in new[1:]:
        extract_shard(store, shard, tiny_model_dir, OUT_REF)
    with pytest.raises(
        IncompleteStage,
        match=rf"1 merged shards not extracted yet \(or extracted from an earlier merge\): \['{new[0]['name']}'\]",
    ):
        commit_extraction(store, MERGE_REF, OUT_REF)
    redone = extract_shard(store, new[0], tiny_model_dir, OUT_REF)
    assert not redone.get("skipped") and redone["merged_shard"]["sha256"] == sha
    assert commit_extraction(store, MERGE_REF, OUT_REF)["totals"]["samples"] == sum(s["samples"] for s in new)
    store.verify(OUT_REF)
