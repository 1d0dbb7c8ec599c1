"""A complete stage is re-checked before it is reused (issue 13): a part deleted, truncated or
rewritten after the commit is named, not trusted by the stages downstream. Real SeaweedFS."""

from __future__ import annotations

import time

import pytest

from eagle3_data.runs.reuse import reusable
from eagle3_data.storage import CorruptArtifact, StageRef
from eagle3_data.storage.writer import StageWriter

REF = StageRef("date=2026-11-30", "reconstruct", "chat")
PARAMS = {"thinking": False}


@pytest.fixture
def stage(store):
    rows = [{"sample_id": f"s{i:02d}", "dataset": "chat", "status": "ok", "output_ids": [i, i + 1]} for i in range(9)]
    with StageWriter(store, REF, "generations", rows_per_part=3, params=PARAMS) as w:
        w.write(rows)
        store.put_json(REF, "report.json", {"rows": 9})
        manifest = w.commit(files=["report.json"])
    assert [p["name"] for p in manifest["parts"]] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    return manifest


def _key(store, name):
    return store.key(REF, name)


def test_sound_stage_is_reused(store, stage):
    assert reusable(store, REF, [], PARAMS)["manifest_sha256"] == stage["manifest_sha256"]
    assert store.quick_check(REF) == []


def test_part_rewritten_after_the_commit_with_the_same_size_is_named(store, stage):
    key = _key(store, "part-00001.parquet")
    obj = store.client.get_object(Bucket=store.bucket, Key=key)
    data = bytearray(obj["Body"].read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, size unchanged, sha256 metadata kept as it was
    time.sleep(1.1)  # S3's Last-Modified has 1 s resolution: the rewrite lands in a later second
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    with pytest.raises(
        CorruptArtifact,
        match=r"part-00001.parquet was rewritten at .* after the manifest .*: the "
        r"complete stage .* changed after its commit, so it is not reused.*stage verify",
    ):
        reusable(store, REF, [], PARAMS)
    with pytest.raises(CorruptArtifact, match="part-00001.parquet"):  # the full check agrees
        store.verify(REF)


def test_missing_or_truncated_parts_and_files_are_named(store, stage):
    store.client.delete_object(Bucket=store.bucket, Key=_key(store, "part-00002.parquet"))
    store.client.put_object(Bucket=store.bucket, Key=_key(store, "report.json"), Body=b"{}")
    problems = store.quick_check(REF)
    assert len(problems) == 2
    assert "part-00002.parquet is listed in the manifest but missing from S3" in problems[0]
    assert "report.json has 2 bytes, the manifest says" in problems[1]
    with pytest.raises(CorruptArtifact, match=r"part-00002.parquet is listed .*\(and 1 more\)"):
        reusable(store, REF, [], PARAMS)
