"""Prompts are streamed (spilled to local Arrow files, hashed as they go), and nothing they
produce changed: the prompts stage's rows and its `rows_sha256` param, and the generation
stages' prompt-derived row fields, are pinned to what the code produced when it held every
prompt in memory.

The golden (`prompts_golden.json` next to this file) was recorded with the code as it was
BEFORE streaming (one list of every row, `canonical_json(rows, ascii_only=True)` hashed whole),
so these tests prove the rewrite changed memory, not output; a changed `rows_sha256` would make
every existing run's prompts stage unreusable. Regenerate only when the output is changed on
purpose (and say so in the commit):

    .venv/bin/python -m tests.unit.test_prompt_streaming --write
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

GOLDEN = Path(__file__).with_name("prompts_golden.json")
DATASET = "gold"
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64, "thinking": True}
TOOL = {
    "type": "function",
    "function": {
        "name": "fill",
        "description": "Füll das Formular aus ✓",
        "parameters": {"type": "object", "properties": {f"f{k}": {"type": "string"} for k in range(12)}},
    },
}


def _record(i: int) -> dict:
    """Prompt i: plain, non-ASCII, with tools, multi-turn with a tool call, or too long."""
    user = {"role": "user", "content": f"question {i}" + (" café ☕ — ü" if i % 7 == 0 else "")}
    if i % 11 == 0:
        call = {"id": f"c{i}", "type": "function", "function": {"name": "fill", "arguments": json.dumps({"f0": "x"})}}
        messages = [
            user,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"},
            {"role": "user", "content": "thanks, again"},
        ]
    elif i % 29 == 0:
        messages = [{"role": "user", "content": "word " * 400}]  # over limits.max_prompt_tokens
    else:
        messages = [{"role": "system", "content": "be brief"}, user] if i % 3 == 0 else [user]
    return {"messages": messages, **({"tools": [TOOL]} if i % 5 == 0 else {})}


def write_prompts(root: Path) -> Path:
    """A dataset folder with a JSONL file (bad rows and a duplicate among the good ones) and a
    Parquet file (messages as JSON strings): both readers, every reject kind the load knows."""
    folder = root / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_record(i), ensure_ascii=i % 2 == 0) for i in range(260)]
    lines[40:40] = [
        "{not json",
        json.dumps({"messages": [{"role": "root", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        lines[3],
        "",
    ]
    (folder / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    records = [_record(i) for i in range(260, 330)]
    pq.write_table(
        pa.Table.from_pylist(
            [{"messages": json.dumps(r["messages"]), "tools": json.dumps(r.get("tools"))} for r in records]
        ),
        folder / "b.parquet",
    )
    return folder


def _run(tokenizer_dir: Path, folder: Path, run_key: str):
    from eagle3_data.config import load_config
    from eagle3_data.runs.run import Run

    config = load_config().with_overrides(
        {
            "tokenizer": {"source": str(tokenizer_dir)},
            "datasets": [{"name": DATASET, "prompts": str(folder)}],
            "generation": {"sampling": SAMPLING, "repeats": 2},
            "limits": {"max_prompt_tokens": 300},
            "routing": {"strategy": "fraction", "overflow_fraction": 0.4, "calibration_samples": 5},
            "validation": {"max_rejected_prompt_rate": 0.02},
        },
        where="test",
    )  # every reject kind: 4 of 334 rows
    return Run(config=config, run_key=run_key, date=None, datasets=[DATASET], dry_run=False, skip_hidden_states=False)


def load_route_fingerprint(store, tokenizer_dir: Path, root: Path, run_key: str) -> dict:
    """What must not change about the prompts stage: its rows, `rows_sha256`, counts, rejects."""
    from eagle3_data import pipeline

    folder = write_prompts(root)
    run = _run(tokenizer_dir, folder, run_key)
    result = pipeline.load_route(run, store, DATASET)
    ref = pipeline.stage_ref(run, "prompts", DATASET)
    manifest = store.read_manifest(ref)
    from eagle3_data.rejects import read_rejects

    # schema v2 added the rows' own ids (`source_id`, provenance: none in these rows), v3 their images
    # (none: text rows): what must not change is the content the golden recorded, and `rows_sha256`
    rows = [
        {k: v for k, v in r.items() if k not in ("source_id", "images") or v is not None}
        for r in store.read_table(ref).to_pylist()
    ]
    rejects = json.loads(json.dumps(read_rejects(store, ref)).replace(str(folder), "SRC"))
    return {
        "rows_sha256": manifest["params"]["rows_sha256"],
        "counts": result.counts,
        "rows": len(rows),
        "rows_digest": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest(),
        "sample_ids": [r["sample_id"] for r in rows],
        "routes": [r["route"] for r in rows],
        "rejects": rejects,
    }


def generation_rows() -> list[dict]:
    """Prompt rows as a caller may pass them to a generation stage: JSON strings (the prompts
    stage's spelling) and decoded lists, tools absent, null, empty or set, every route."""
    rows = []
    for i in range(40):
        record = _record(i)
        as_text = i % 2 == 0
        tools = record.get("tools") if i % 4 else ([] if i % 8 == 0 else None)
        rows.append(
            {
                "sample_id": f"s{i:03d}",
                "dataset": DATASET if i % 3 else None,
                "messages": json.dumps(record["messages"], ensure_ascii=False) if as_text else record["messages"],
                "tools": (json.dumps(tools) if as_text else tools) if tools is not None else None,
                "route": ["local", "overflow", "both", None][i % 4],
            }
        )
    return rows


def parse_fingerprint() -> list[dict]:
    """What the generation stages take from each prompt: the row fields copied into their rows
    (`generation_row`), the decoded messages/tools sent, and the sampling of calibration samples."""
    from eagle3_data.stages.generate.checkpoint import generation_row, parse_prompts, sampling_for

    out = []
    for p in parse_prompts(generation_rows(), DATASET, ("local", "both")):
        out.append(
            {
                "base_row": generation_row(p, [1, 2], "sglang"),
                "messages": p.messages,
                "tools": p.tools,
                "sampling": sampling_for(p, {"temperature": 1.0}),
            }
        )
    return out


# -- tests ----------------------------------------------------------------------------------------
def test_load_route_rows_and_hash_match_the_pre_streaming_golden(store, kimi_tokenizer_dir, tmp_path, monkeypatch):
    """Same input -> same prompts stage as before streaming, written in several bounded parts."""
    from eagle3_data.stages.prompts import stage as route

    monkeypatch.setattr(route, "PROMPT_ROWS_PER_PART", 97)  # several parts, one cut inside a spill batch
    golden = json.loads(GOLDEN.read_text())["load_route"]
    assert golden["counts"]["rejects"] >= 4 and golden["counts"]["both"] == 5  # the golden exercises rejects and routes
    got = load_route_fingerprint(store, kimi_tokenizer_dir, tmp_path, "golden")
    assert got == golden
    manifest = store.read_manifest(
        route.stage_ref(_run(kimi_tokenizer_dir, tmp_path / DATASET, "golden"), "prompts", DATASET)
    )
    assert len(manifest["parts"]) == -(-got["rows"] // 97)


def test_generation_prompts_match_the_pre_streaming_golden():
    assert parse_fingerprint() == json.loads(GOLDEN.read_text())["parse_prompts"]


def test_rows_sha256_streams_the_hash_of_the_whole_list(tmp_path):
    """The incremental hash is sha256(canonical_json(all rows, ascii_only=True)), computed here
    the old way from the whole list, over several spill batches, non-ASCII text and nulls."""
    from eagle3_data.canonical import canonical_json
    from eagle3_data.config import RoutingConfig
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts
    from eagle3_data.stages.prompts.routing import assign_routes
    from eagle3_data.stages.prompts.stage import routed_batches, rows_sha256

    load = load_prompts(str(write_prompts(tmp_path)), DATASET, PromptShape(sampling=SAMPLING, repeats=4))
    rows = list(load.rows)
    assert len(rows) > 2 * 512  # more than two spill batches
    routes = assign_routes([r["sample_id"] for r in rows], RoutingConfig(overflow_fraction=0.3, calibration_samples=4))
    # source_id (provenance) and a text row's null images (schema v3) are left out of the hash
    whole = [
        {**{k: v for k, v in r.items() if k != "source_id" and not (k == "images" and v is None)}, "route": route}
        for r, route in zip(rows, routes)
    ]
    assert any("\\u" in canonical_json(r, ascii_only=True) for r in whole)  # the escaped spelling matters here
    assert (
        rows_sha256(routed_batches(load.rows, routes))
        == hashlib.sha256(canonical_json(whole, ascii_only=True).encode()).hexdigest()
    )
    assert [
        {k: v for k, v in r.items() if k != "source_id" and not (k == "images" and v is None)}
        for b in routed_batches(load.rows, routes)
        for r in b.to_pylist()
    ] == whole
    assert rows_sha256([]) == hashlib.sha256(canonical_json([], ascii_only=True).encode()).hexdigest()


def test_token_limit_drops_rows_from_the_spill_and_keeps_order(tmp_path):
    from eagle3_data.stages.prompts.load import PromptShape, limit_prompt_tokens, load_prompts

    def count(messages, tools):
        return sum(len(m.get("content") or "") for m in messages)

    load = load_prompts(str(write_prompts(tmp_path)), DATASET, PromptShape(sampling=SAMPLING, repeats=2))
    before = list(load.rows)
    limit_prompt_tokens(load, 60, count)
    long = {r["sample_id"] for r in before if count(json.loads(r["messages"]), None) > 60}
    assert long and [r["sample_id"] for r in load.rows] == [
        r["sample_id"] for r in before if r["sample_id"] not in long
    ]
    assert len(load.rows) == load.counts["rows"] == len(before) - len(long)


def test_generation_stream_is_validated_before_anything_is_spilled_back(tmp_path):
    """A bad row anywhere fails the whole parse (before any request), even after many good rows
    already spilled; the pending prompts are decoded lazily, those done are skipped."""
    from eagle3_data.errors import UserError
    from eagle3_data.stages.generate.checkpoint import parse_prompts

    rows = generation_rows()
    bad = [*rows, {"sample_id": "late", "dataset": DATASET, "messages": "[]", "tools": None, "route": "local"}]
    with pytest.raises(UserError, match=r"prompt 40 \(sample_id 'late'\): field 'messages' must be a non-empty list"):
        parse_prompts(iter(bad), DATASET, None)
    prompts = parse_prompts(iter(rows), DATASET, None)
    assert len(prompts) == len(prompts.ids) == 40
    pending = prompts.iter(skip={"s000", "s039"})
    assert [p.sample_id for p in pending] == [f"s{i:03d}" for i in range(1, 39)]
    assert [p.sample_id for p in prompts] == prompts.ids  # the spill is read again, as often as needed


def _write_golden() -> None:
    import secrets
    import tempfile

    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.storage import ArtifactStore

    tokenizer = cached_kimi_tokenizer(Path(__file__).resolve().parents[2] / ".cache")
    with tempfile.TemporaryDirectory(prefix="golden-prompts-") as tmp:
        handle = start_seaweedfs(
            Path(tmp) / "s3",
            access_key="g-" + secrets.token_hex(4),
            secret_key=secrets.token_hex(16),
            die_with_parent=True,
        )
        try:
            client = handle.client()
            client.create_bucket(Bucket="golden")
            store = ArtifactStore(client=client, bucket="golden", prefix="eagle3-datagen")
            out = {
                "load_route": load_route_fingerprint(store, tokenizer, Path(tmp) / "in", "golden"),
                "parse_prompts": parse_fingerprint(),
            }
        finally:
            stop_seaweedfs(Path(tmp) / "s3", grace=0.5)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}: {out['load_route']['rows']} prompt rows, {len(out['parse_prompts'])} parsed prompts")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.test_prompt_streaming --write")
    _write_golden()
