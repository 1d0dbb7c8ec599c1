"""Merge output bytes are pinned: a seeded synthetic input must merge to the recorded parts.

The golden (`merge_golden.json` next to this file) was recorded with the merge code as it was
BEFORE the token-bounded rewrite (row buckets, Python lists), so this test is the proof that the
rewrite changed memory, not output: same shard files byte for byte (sha256 and size), same
per-dataset statistics and shard list in the manifest, for several bucket sizes.

Regenerate (only when the output format is changed on purpose, and say so in the commit):

    .venv/bin/python -m tests.unit.test_merge_golden --write

It starts its own SeaweedFS on free ports, writes the seeded inputs below through the real
ArtifactStore, merges them with every case in CASES and writes the fingerprints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eagle3_data.storage.writer import StageWriter

GOLDEN = Path(__file__).with_name("merge_golden.json")
RUN = "date=2026-11-30"
VOCAB = 163_840
# name -> merge keyword arguments; bucket size is varied separately (it must not change the bytes)
CASES = {
    "truncate_big_shards": {"max_length": 256, "length_policy": "truncate", "shard_tokens": 300_000, "seed": 7},
    "drop_small_shards": {"max_length": 200, "length_policy": "drop", "shard_tokens": 9_000, "seed": 11},
}


def _row(rng: random.Random, sid: str, dataset: str | None, source: str, status: str = "ok") -> dict:
    """One generations row; lengths straddle the cases' max_length so truncation and drops happen."""
    ok = status == "ok"
    prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 17, 60, 120, 210, 260]))] if ok else None
    output = (
        [rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 5, 40, 90, 150, 300]) if rng.random() < 0.97 else 0)]
        if ok
        else None
    )
    if ok and not output and rng.random() < 0.7:
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 80))]
    return {
        "sample_id": sid,
        "dataset": dataset,
        "messages": "[]",
        "tools": None,
        "prompt_ids": prompt,
        "output_ids": output,
        "source": source,
        "status": status,
        "error": None if ok else "boom",
        "reasoning": None,
        "content": None,
        "tool_calls": None,
        "finish_reason": rng.choice(["stop", "length", "tool_calls", None]),
        "usage": None,
        "provenance": None if rng.random() < 0.1 else json.dumps({"model": "tiny", "i": rng.randrange(1000)}),
    }


def write_inputs(store) -> list:
    """Three seeded input stages: local chat, its overflow (overlapping ids), local tools."""
    from eagle3_data.storage import StageRef

    rng = random.Random(20261130)
    local = StageRef(RUN, "generate_local", "chat")
    overflow = StageRef(RUN, "reconstruct", "chat")
    tools = StageRef(RUN, "generate_local", "tools")
    stages = {
        local: [
            _row(rng, f"c{i}", rng.choice(["chat", None]), "sglang", rng.choices(["ok", "failed"], [0.97, 0.03])[0])
            for i in range(2600)
        ]
        + [_row(rng, f"c{i}", "chat", "sglang") for i in range(0, 2600, 97)],  # in-input duplicates
        overflow: [_row(rng, f"c{i}", "chat", "openrouter") for i in range(0, 2600, 13)]  # overlap: local wins
        + [
            _row(
                rng,
                f"o{i}",
                "chat",
                "openrouter",
                rng.choices(["ok", "failed", "unreconstructable"], [0.9, 0.05, 0.05])[0],
            )
            for i in range(900)
        ],
        tools: [_row(rng, f"t{i}", "tools", "sglang") for i in range(1300)],
    }
    for ref, rows in stages.items():
        with StageWriter(
            store, ref, "generations", rows_per_part=500, tokenizer_sha256="tok", template_sha256="tpl"
        ) as w:
            w.write(rows)
            w.commit()
    return list(stages)


def fingerprint(store, inputs, run_key: str, tokens_per_bucket: int, **config) -> dict:
    """What must not change: the shard files' bytes and the manifest's shard list and statistics
    (the draft vocabulary, added after the golden was recorded, is `vocab_of`'s)."""
    from eagle3_data.config import MergeConfig
    from eagle3_data.stages.merge.datasets import MergeContext, merge_datasets
    from eagle3_data.storage import StageRef

    merge_datasets(
        store,
        inputs,
        run_key,
        MergeConfig(**config),
        context=MergeContext(tokens_per_bucket=tokens_per_bucket),
        vocab_size=VOCAB,
    )
    manifest = store.read_manifest(StageRef(run_key, "merge", "all"))
    extra = {k: v for k, v in manifest["extra"].items() if k != "draft_vocab"}
    return {
        "files": [f for f in manifest["files"] if f["name"].startswith("shard-")],
        "params": {k: v for k, v in manifest["params"].items() if k != "draft_vocab_size"},
        "rows_in_shards": [s["samples"] for s in manifest["extra"]["shards"]],
        "extra": json.loads(json.dumps(extra).replace(run_key, "RUN")),
        "tokenizer_sha256": manifest["tokenizer_sha256"],
    }


def vocab_of(store, run_key: str) -> tuple:
    """The draft vocabulary's files (name, sha256) and summary of a merge."""
    from eagle3_data.storage import StageRef

    manifest = store.read_manifest(StageRef(run_key, "merge", "all"))
    files = tuple((f["name"], f["sha256"]) for f in manifest["files"] if not f["name"].startswith("shard-"))
    return files, json.dumps(manifest["extra"]["draft_vocab"], sort_keys=True)


@pytest.fixture(scope="module")
def golden_inputs(s3_server):
    import uuid

    from eagle3_data.storage import ArtifactStore

    client = s3_server.client()
    bucket = f"golden-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    store = ArtifactStore(client=client, bucket=bucket, prefix="eagle3-datagen")
    return store, write_inputs(store)


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_bytes_match_the_pre_rewrite_golden(golden_inputs, case):
    store, inputs = golden_inputs
    golden = json.loads(GOLDEN.read_text())[case]
    assert sum(golden["rows_in_shards"]) > 2000 and len(golden["files"]) >= 2  # the golden exercises shards
    vocabs = set()
    for i, bucket_kwargs in enumerate(_bucket_variants()):
        got = fingerprint(store, inputs, f"{RUN}-{case}-{i}", **CASES[case], **bucket_kwargs)
        assert got == golden, f"{case} with {bucket_kwargs}: merge output differs from the recorded golden"
        vocabs.add(vocab_of(store, f"{RUN}-{case}-{i}"))
    assert len(vocabs) == 1  # the draft vocabulary's bytes do not depend on how the merge buckets


def _bucket_variants() -> list[dict]:
    """One bucket, ~25 buckets of 20k tokens, and the 256-bucket cap (a budget of 1 token)."""
    return [{"tokens_per_bucket": 1 << 30}, {"tokens_per_bucket": 20_000}, {"tokens_per_bucket": 1}]


def test_buckets_are_cut_by_tokens_and_keep_copies_together(golden_inputs, tmp_path):
    """Pass 1b: each bucket holds about its token budget (plus at most one sample), every copy of a
    sample sits in one bucket, and the buckets are consecutive, disjoint ranges of the key order."""
    from collections import Counter, defaultdict

    import pyarrow as pa
    import pyarrow.compute as pc

    from eagle3_data.stages.merge.datasets import _partition, _spill

    store, inputs = golden_inputs
    keys, tokens = _spill(store, inputs, 7, defaultdict(Counter), tmp_path / "spill.arrow")
    budget = 20_000
    buckets = _partition(tmp_path / "spill.arrow", keys, tokens, budget, tmp_path)
    assert len(buckets) >= int(tokens.sum()) // budget - 1 and not (tmp_path / "spill.arrow").exists()
    seen, last_max = set(), -1
    for path in buckets:
        with pa.ipc.open_stream(str(path)) as reader:
            t = reader.read_all()
        n = pc.sum(pc.add(pc.list_value_length(t["prompt_ids"]), pc.list_value_length(t["output_ids"]))).as_py()
        assert n <= budget + int(tokens.max()) * 3  # one sample (<= 3 copies) may straddle a cut
        sids = set(t["sample_id"].to_pylist())
        assert not sids & seen
        seen |= sids
        assert pc.min(t["key"]).as_py() > last_max
        last_max = pc.max(t["key"]).as_py()
    assert len(seen) == len({*keys.tolist()})


def test_chunk_records_equal_the_per_row_reference():
    """_build_records (flat numpy buffers) == build_record (Python lists) row by row, truncation included."""
    import random

    import pyarrow as pa

    from eagle3_data.stages.merge.datasets import _BUCKET_SCHEMA, _build_records, _drop_reason, build_record

    rng = random.Random(5)
    rows = []
    for i in range(300):
        p, o = rng.choice([1, 2, 7, 31, 32, 40]), rng.choice([1, 3, 25, 33, 90])
        rows.append(
            {
                "key": i,
                "rank": 0,
                "order": i,
                "sample_id": f"s{i}",
                "dataset": "d",
                "source": "sglang",
                "prompt_ids": [rng.randrange(VOCAB) for _ in range(p)],
                "output_ids": [rng.randrange(VOCAB) for _ in range(o)],
                "finish_reason": "stop",
                "provenance": None,
            }
        )
    kept = [r for r in rows if _drop_reason(len(r["prompt_ids"]), len(r["output_ids"]), 32, "truncate") is None]
    assert 0 < len(kept) < len(rows)
    got = _build_records(pa.Table.from_pylist(kept, schema=_BUCKET_SCHEMA), 32).to_pylist()
    want = [build_record(r, 32, "truncate")[0] for r in kept]
    assert got == want and any(r["truncated"] for r in want)


def _write_golden() -> None:
    import secrets
    import tempfile

    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.storage import ArtifactStore

    with tempfile.TemporaryDirectory(prefix="golden-s3-") as root:
        handle = start_seaweedfs(
            root, access_key="g-" + secrets.token_hex(4), secret_key=secrets.token_hex(16), die_with_parent=True
        )
        try:
            client = handle.client()
            client.create_bucket(Bucket="golden")
            store = ArtifactStore(client=client, bucket="golden", prefix="eagle3-datagen")
            inputs = write_inputs(store)
            out = {
                case: fingerprint(store, inputs, f"{RUN}-{case}-0", **kw, **_bucket_variants()[-1])
                for case, kw in CASES.items()
            }
        finally:
            stop_seaweedfs(root, grace=0.5)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: " + ", ".join(f"{c}: {len(v['files'])} shards" for c, v in out.items()))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.test_merge_golden --write")
    _write_golden()
