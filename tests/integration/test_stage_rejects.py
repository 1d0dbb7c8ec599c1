"""Loud rejects in the row stages after generation (issue 13): reconstruct and validate write
`rejects.parquet` (the prompt loader's rejects schema) beside their parts, log a count per reason
with the first rows of each, and commit nothing when rows came in but none was accepted."""

from __future__ import annotations

import io
import json
import logging

import pyarrow.parquet as pq
import pytest

from eagle3_data.config import load_config
from eagle3_data.errors import GateFailed, UserError
from eagle3_data.schemas import schema_for
from eagle3_data.storage import StageRef
from eagle3_data.storage.writer import StageWriter

RUN = "date=2026-11-30"
IM_END = 163586


@pytest.fixture
def run(kimi_tokenizer_dir):
    from eagle3_data.runs.run import Run

    config = load_config().with_overrides(
        {"tokenizer": {"source": str(kimi_tokenizer_dir)}, "generation": {"sampling": {"thinking": False}}},
        where="test",
    )
    return Run(
        config=config, run_key=RUN, date=None, datasets=config.dataset_names, dry_run=False, skip_hidden_states=False
    )


def _row(sid, **kw):
    row = {
        "sample_id": sid,
        "dataset": "d",
        "messages": json.dumps([{"role": "user", "content": "hi"}]),
        "tools": None,
        "prompt_ids": [1, 2],
        "output_ids": None,
        "source": "openrouter",
        "status": "ok",
        "error": None,
        "reasoning": None,
        "content": f"answer {sid}",
        "tool_calls": None,
        "finish_reason": "stop",
        "usage": None,
        "provenance": "{}",
    }
    return {**row, **kw}


def _write(store, ref, rows):
    with StageWriter(store, ref, "generations", rows_per_part=3, tokenizer_sha256="tok", template_sha256="tpl") as w:
        w.write(rows)
        w.commit()


def _rejects(store, ref) -> list[dict]:
    table = pq.read_table(io.BytesIO(store.get_bytes(ref, "rejects.parquet")))
    assert table.schema.equals(schema_for("rejects"), check_metadata=False)
    return table.to_pylist()


def test_reconstruct_rejects_malformed_and_unreconstructable_rows_loudly(run, store, caplog):
    from eagle3_data.pipeline import reconstruct

    dataset = run.datasets[0]
    src, ref = StageRef(RUN, "generate_overflow", dataset), StageRef(RUN, "reconstruct", dataset)
    _write(
        store,
        src,
        [
            _row("a"),
            _row("b", tool_calls="not json"),
            _row("c"),
            _row("f", status="failed", error="timeout"),
            _row("d", finish_reason=None),
            _row("e", finish_reason="content_filter"),
            _row("g", tool_calls="[1"),
        ],
    )
    with caplog.at_level(logging.INFO, logger="eagle3_data.pipeline"):
        result = reconstruct(run, store, dataset)
    assert result.rows == 7 and not result.reused  # every paid row is kept in the stage
    rejects = _rejects(store, ref)
    got = sorted((r["line"], r["field"], json.loads(r["raw"])["sample_id"]) for r in rejects)
    assert got == [(2, "tool_calls", "b"), (5, "finish_reason", "d"), (6, "output", "e"), (7, "tool_calls", "g")]
    assert all(r["source"] == store.uri(src) and r["dataset"] == dataset and r["reason"] for r in rejects)
    counts = store.read_manifest(ref)["extra"]["counts"]
    assert (counts["ok"], counts["rejected"], counts["unreconstructable"], counts["failed"]) == (2, 3, 1, 1)
    log = caplog.text
    assert f"reconstruct {dataset}: REJECTED 4 of 6 rows" in log
    assert "2 x tool_calls: " in log and "row 2 field tool_calls" in log and "row 7 field tool_calls" in log
    assert "1 x finish_reason: " in log and "row 6 field output: unreconstructable: finish_reason" in log
    store.verify(ref)  # rejects.parquet is one of the manifest's files
    assert {f["name"] for f in store.read_manifest(ref)["files"]} == {"rejects.parquet"}
    rebuilt = {r["sample_id"]: r for r in store.read_table(ref).to_pylist()}
    assert rebuilt["b"]["status"] == "unreconstructable" and rebuilt["b"]["error"].startswith("rejected: ")
    assert rebuilt["a"]["output_ids"] and rebuilt["a"]["output_ids"][-1] == IM_END


def test_reconstruct_with_no_usable_row_commits_nothing(run, store):
    from eagle3_data.pipeline import reconstruct

    dataset = run.datasets[0]
    src, ref = StageRef(RUN, "generate_overflow", dataset), StageRef(RUN, "reconstruct", dataset)
    _write(store, src, [_row("b", tool_calls="not json"), _row("d", finish_reason=None)])
    with pytest.raises(
        UserError,
        match=rf"reconstruct {dataset}: 0 of 2 rows accepted \(2 rejected; first: field "
        r"'tool_calls'.*nothing committed; rejects: s3://.*rejects.parquet",
    ):
        reconstruct(run, store, dataset)
    assert not store.is_complete(ref)
    assert len(_rejects(store, ref)) == 2


def _validate_inputs(run, store, dataset, local_rows):
    from eagle3_data.pipeline import reconstruct

    _write(store, StageRef(RUN, "generate_local", dataset), local_rows)
    _write(store, StageRef(RUN, "generate_overflow", dataset), [])
    reconstruct(run, store, dataset)
    with StageWriter(store, StageRef(RUN, "prompts", dataset), "prompts", rows_per_part=8) as w:
        w.commit()


def _local(sid, ids):
    return _row(sid, source="sglang", output_ids=ids, content=None)


def test_validate_writes_rejects_for_unreadable_rows(run, store, kimi_tokenizer, caplog):
    from eagle3_data.pipeline import validate

    dataset = run.datasets[0]
    good = kimi_tokenizer.encode("Hello there.", add_special_tokens=False) + [IM_END]
    _validate_inputs(
        run,
        store,
        dataset,
        [_local("a", good), _local("b", [10**8]), _local("c", good), _local("d", None), _local("e", good)],
    )
    ref = StageRef(RUN, "validate", dataset)
    with caplog.at_level(logging.INFO, logger="eagle3_data.pipeline"):
        try:
            validate(run, store, dataset, workers=1)
        except GateFailed as exc:  # 2 bad rows of 5 exceed max_bad_row_rate 0: the gate says so
            assert "bad row" in str(exc)
    rejects = _rejects(store, ref)
    assert sorted((r["line"], r["field"], json.loads(r["raw"])["sample_id"]) for r in rejects) == [
        (2, "output_ids", "b"),
        (4, "output_ids", "d"),
    ]
    assert (
        f"validate {dataset}: REJECTED 2 of 5 rows" in caplog.text
        and "row 2 field output_ids: id 100000000" in caplog.text
    )
    assert "rejects.parquet" in {f["name"] for f in store.read_manifest(ref)["files"]}
    store.verify(ref)


def test_validate_with_no_readable_row_commits_nothing(run, store):
    from eagle3_data.pipeline import validate

    dataset = run.datasets[0]
    _validate_inputs(run, store, dataset, [_local("b", [10**8]), _local("d", None)])
    ref = StageRef(RUN, "validate", dataset)
    with pytest.raises(UserError, match=rf"validate {dataset}: 0 of 2 rows accepted .*nothing committed"):
        validate(run, store, dataset, workers=1)
    assert not store.is_complete(ref)
    assert len(_rejects(store, ref)) == 2
