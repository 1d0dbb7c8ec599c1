"""Bulk mismatch validation with the real Kimi tokenizer: classes, first_diff, report, bad rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.chat_format import get_output_format
from eagle3_data.errors import UserError
from eagle3_data.validate import (
    BadRow,
    InputRow,
    RowResult,
    compare_billed_counts,
    rows_from_batches,
    rows_from_file,
    validate_batches,
    validate_rows,
    validate_to_report,
    validation_rows_table,
)

REFERENCE_IDS = [9413, 1019, 2704, 13, 163607, 1008, 7574, 387, 220, 5512, 13, 163586]
IM_END_AS_TEXT = [27, 91, 348, 11129, 91, 29]
VOCAB = 163840


@pytest.fixture(scope="module")
def enc(kimi_tokenizer):
    codec = get_output_format(kimi_tokenizer).codec
    return lambda text: codec.encode_batch([text])[0]


def _one(tok, ids, finish=None) -> RowResult:
    [result] = validate_rows(tok, [InputRow("line 1", "s", ids, finish)])
    return result


def test_exact_with_and_without_stop_id(kimi_tokenizer):
    assert _one(kimi_tokenizer, REFERENCE_IDS).cls == "exact"
    assert _one(kimi_tokenizer, REFERENCE_IDS[:-1], "stop").cls == "exact"  # normalised
    assert _one(kimi_tokenizer, REFERENCE_IDS[:-1], "length").cls == "exact"


def test_bpe_split_is_bpe_only_with_first_diff(kimi_tokenizer, enc):
    ids = enc("Hmm.</think>Neither A NOR B.<|im_end|>")
    pos = ids.index(93622)
    sampled = ids[:pos] + [575, 1292] + ids[pos + 1 :]
    result = _one(kimi_tokenizer, sampled)
    assert result.cls == "bpe_only"
    assert result.first_diff == pos
    assert result.original == [" N", "OR"] and result.reconstructed == [" NOR"]
    assert result.agreed_tokens == len(sampled) - 2


def test_literal_special_token_text_is_special_token(kimi_tokenizer, enc):
    ids = enc("r</think>Say ") + IM_END_AS_TEXT + enc(" now.<|im_end|>")
    result = _one(kimi_tokenizer, ids)
    assert result.cls == "special_token"
    assert result.first_diff == len(enc("r</think>Say "))
    assert result.reconstructed == ["<|im_end|>"] and "".join(result.original) == "<|im_end|>"


def test_tool_calls_exact_and_renumbered_ids_differ(kimi_tokenizer, enc):
    section = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{{\"a\": 1}}"
        "<|tool_call_end|><|tool_call_begin|>functions.g:{n}<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )
    assert _one(kimi_tokenizer, enc("think</think>" + section.format(n=4))).cls == "exact"
    # The model numbered its second call 3 again: reconstruction renumbers it 4.
    renumbered = _one(kimi_tokenizer, enc("think</think>" + section.format(n=3)))
    assert renumbered.cls == "text_diff"


def test_truncation_inside_reasoning_and_content_is_exact(kimi_tokenizer, enc):
    ids = enc("A long line of thought</think>And an answer that goes on")
    for cut in (3, len(ids) - 2):
        assert _one(kimi_tokenizer, ids[:cut], "length").cls == "exact"


def test_truncation_inside_multibyte_char_is_text_diff(kimi_tokenizer, enc, kimi_tokenizer_dir):
    ids = enc("r</think>emoji 🦜")
    tail = enc("🦜")
    assert len(tail) > 1, "needs a character spread over several tokens"
    result = _one(kimi_tokenizer, ids[:-1], "length")
    assert result.cls == "text_diff"
    assert result.first_diff == len(ids) - len(tail)


def test_report_keys_counts_and_gate(kimi_tokenizer, enc):
    bpe = enc("x</think>A NOR B<|im_end|>")
    bpe = bpe[: bpe.index(93622)] + [575, 1292] + bpe[bpe.index(93622) + 1 :]
    rows = [InputRow(f"line {i}", f"s{i}", REFERENCE_IDS) for i in range(9)] + [InputRow("line 10", "s9", bpe)]
    report = validate_to_report(kimi_tokenizer, rows)
    assert set(report) == {"samples", "counts", "sample_mismatch_rate", "token_agreement", "mismatches", "bad_rows", "gate"}
    assert report["counts"] == {"exact": 9, "bpe_only": 1, "special_token": 0, "text_diff": 0}
    assert report["sample_mismatch_rate"] == pytest.approx(0.1)
    assert report["token_agreement"] == pytest.approx(1 - 2 / (9 * 12 + len(bpe)))
    assert report["mismatches"] == [
        {"sample_id": "s9", "class": "bpe_only", "first_diff": bpe.index(575), "original": [" N", "OR"], "reconstructed": [" NOR"]}
    ]
    assert report["gate"] == {"passed": True, "reasons": []}
    strict = validate_to_report(kimi_tokenizer, rows, max_bpe_mismatch_rate=0.05)
    assert not strict["gate"]["passed"] and "bpe_only rate 0.1000 exceeds 0.05" in strict["gate"]["reasons"][0]
    special = validate_to_report(kimi_tokenizer, rows[:2] + [InputRow("l", "x", REFERENCE_IDS[:4] + IM_END_AS_TEXT)])
    assert special["gate"] == {"passed": False, "reasons": ["1 sample(s) classified special_token"]}


def test_forked_workers_give_the_same_results(kimi_tokenizer, enc):
    rows = [InputRow(f"line {i}", f"s{i}", enc(f"step {i}</think>answer {'NOR ' * (i % 3)}<|im_end|>")) for i in range(40)]
    rows[7] = InputRow("line 8", "s7", REFERENCE_IDS[:4] + IM_END_AS_TEXT)
    serial = list(validate_rows(kimi_tokenizer, rows, chunk_rows=6))
    forked = list(validate_rows(kimi_tokenizer, rows, chunk_rows=6, workers=2))
    assert forked == serial
    assert [r.cls for r in forked].count("special_token") == 1


@pytest.mark.timeout(120)
def test_forked_workers_finish_under_a_host_sigterm_handler_that_does_not_exit(kimi_tokenizer, enc):
    """A host process (an Airflow task; pytest after dag.test) may hold a SIGTERM handler that does
    not exit, and forked workers inherit it: a pool that relied on SIGTERM to stop them hung a full
    run once. Workers must be reaped both after a complete run and after an early stop."""
    import multiprocessing
    import signal

    rows = [InputRow(f"line {i}", f"s{i}", enc(f"step {i}</think>answer<|im_end|>")) for i in range(12)]
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        assert [r.cls for r in validate_rows(kimi_tokenizer, rows, chunk_rows=3, workers=2)] == ["exact"] * 12
        stopped_early = validate_rows(kimi_tokenizer, rows, chunk_rows=3, workers=2)
        assert next(stopped_early).cls == "exact"
        stopped_early.close()  # GeneratorExit inside the pool: workers must still be reaped
        for _ in range(5):  # a bad first row stops the pool while its workers are still starting
            bad_first = [BadRow("line 0", "s0", "output_ids", "missing")] + rows
            with pytest.raises(UserError, match="line 0"):
                list(validate_rows(kimi_tokenizer, bad_first, chunk_rows=3, workers=2))
        assert multiprocessing.active_children() == []
    finally:
        signal.signal(signal.SIGTERM, previous)


def _jsonl(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n" for line in lines))
    return path


BAD_LINES = [
    {"sample_id": "ok1", "output_ids": REFERENCE_IDS},
    "{not json",
    {"sample_id": "no-ids"},
    {"sample_id": "floats", "output_ids": [1, 2.5]},
    {"sample_id": "oov", "output_ids": [1, 163840]},
    {"sample_id": "neg", "output_ids": [-1]},
    {"sample_id": "fin", "output_ids": [1], "finish_reason": "content_filter"},
    {"output_ids": [1]},
    b'{"sample_id": "\xff"}',
    {"sample_id": "ok2", "output_ids": REFERENCE_IDS, "finish_reason": "stop"},
]


def test_bad_rows_fail_naming_row_and_field(kimi_tokenizer, tmp_path):
    path = _jsonl(tmp_path / "in.jsonl", BAD_LINES)
    with pytest.raises(UserError, match=r"line 2: field '<line>': invalid JSON"):
        validate_to_report(kimi_tokenizer, rows_from_file(path, VOCAB))


def test_bad_rows_skipped_and_listed(kimi_tokenizer, tmp_path):
    path = _jsonl(tmp_path / "in.jsonl", BAD_LINES)
    report = validate_to_report(kimi_tokenizer, rows_from_file(path, VOCAB), on_bad_row="skip")
    assert report["counts"]["exact"] == 2 and report["samples"] == 2
    assert [(b["row"], b["sample_id"], b["field"]) for b in report["bad_rows"]] == [
        ("line 2", None, "<line>"),
        ("line 3", "no-ids", "output_ids"),
        ("line 4", "floats", "output_ids"),
        ("line 5", "oov", "output_ids"),
        ("line 6", "neg", "output_ids"),
        ("line 7", "fin", "finish_reason"),
        ("line 8", None, "sample_id"),
        ("line 9", None, "<line>"),
    ]
    assert "non-integer id 2.5" in report["bad_rows"][2]["error"]
    assert "id 163840 outside the vocabulary" in report["bad_rows"][3]["error"]


def test_parquet_batches_and_validation_rows_table(kimi_tokenizer, tmp_path):
    table = pa.table({
        "sample_id": ["a", "b", "c"],
        "output_ids": pa.array([REFERENCE_IDS, None, [5, 999999]], pa.list_(pa.int32())),
        "finish_reason": ["stop", "stop", "length"],
    })
    pq.write_table(table, tmp_path / "in.parquet")
    items = list(validate_rows(kimi_tokenizer, rows_from_file(tmp_path / "in.parquet", VOCAB, batch_rows=2), on_bad_row="skip"))
    assert list(validate_batches(kimi_tokenizer, pq.ParquetFile(tmp_path / "in.parquet").iter_batches(2), on_bad_row="skip")) == items
    assert isinstance(items[0], RowResult) and items[0].cls == "exact"
    assert [(b.where, b.sample_id, b.field) for b in items[1:]] == [("row 2", "b", "output_ids"), ("row 3", "c", "output_ids")]
    out = validation_rows_table(items, dataset="demo", source="sglang")
    assert out.schema.names[:4] == ["sample_id", "dataset", "source", "class"]
    assert out.to_pylist()[0]["output_tokens"] == 12
    with pytest.raises(UserError, match="no column 'output_ids'"):
        list(rows_from_batches([pa.record_batch({"sample_id": ["x"]})], VOCAB))


def test_billing_deviation():
    ok = compare_billed_counts([("a", 1000, 1000), ("b", 2000, 2004)])
    assert ok["deviation"] == pytest.approx(4 / 3000) and not ok["gate"]["passed"] is False
    assert ok["worst_samples"][0]["sample_id"] == "b"
    bad = compare_billed_counts([("a", 1000, 1100)], max_aggregate_deviation=0.05)
    assert not bad["gate"]["passed"] and "+10.0000%" in bad["gate"]["reasons"][0]


def test_billing_excludes_unreconstructable_rows_and_still_gates_faithful_ones():
    cut = "truncated inside tool-call section"
    rows = [("a", 1000, 1000, None), ("b", 48, 30, cut), ("c", 48, 20, cut), ("d", 500, 500)]
    ok = compare_billed_counts(rows)
    assert ok["gate"]["passed"] and ok["deviation"] == 0.0 and ok["rows"] == 2
    assert ok["excluded"] == {"rows": 2, "billed_completion_tokens": 96, "reasons": {cut: 2}}
    assert ok["gate"]["notes"] == [f"2 row(s) excluded from the deviation and from training data, unreconstructable: {cut}"]
    assert {w["sample_id"] for w in ok["worst_samples"]} == {"a", "d"}
    bad = compare_billed_counts([*rows, ("e", 1000, 900, None)])
    assert not bad["gate"]["passed"] and bad["excluded"]["rows"] == 2
    assert bad["deviation"] == pytest.approx(-100 / 2500)
