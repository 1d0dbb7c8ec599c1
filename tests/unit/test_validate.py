"""Bulk mismatch validation with the real Kimi tokenizer: classes, first_diff, report, bad rows,
the provider's view, stop provenance, and gates that cannot pass on nothing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.errors import UserError
from eagle3_data.stages.validate import (
    CLASSES,
    BadRow,
    InputRow,
    RowResult,
    compare_billed_counts,
    compare_billed_prompts,
    detect_stop_convention,
    rows_from_batches,
    rows_from_file,
    validate_batches,
    validate_rows,
    validate_to_report,
    validation_rows_table,
)
from tests.fixtures.kimi import CHAS, IM_END, IM_END_AS_TEXT, REFERENCE_IDS, THINK_END
from tests.fixtures.kimi import VOCAB_SIZE as VOCAB


@pytest.fixture(scope="module")
def fmt(kimi_fmt):
    return kimi_fmt


@pytest.fixture(scope="module")
def enc(fmt):
    return lambda text: fmt.codec.encode_batch([text])[0]


def _run(fmt, rows, **kw) -> list:
    return list(validate_rows(fmt, rows, stops=detect_stop_convention(fmt, rows), **kw))


def _one(fmt, ids, finish=None, **kw) -> RowResult:
    [result] = _run(fmt, [InputRow("line 1", "s", ids, finish, **kw)])
    return result


def test_exact_with_and_without_stop_id(fmt):
    assert _one(fmt, REFERENCE_IDS).cls == "exact"
    assert _one(fmt, REFERENCE_IDS[:-1], "stop").cls == "exact"  # normalised
    assert _one(fmt, REFERENCE_IDS[:-1], "length").cls == "exact"


def test_bpe_split_is_bpe_only_with_first_diff(fmt, enc):
    ids = enc("Hmm.</think>Neither A NOR B.<|im_end|>")
    pos = ids.index(93622)
    sampled = ids[:pos] + [575, 1292] + ids[pos + 1 :]
    result = _one(fmt, sampled)
    assert result.cls == "bpe_only"
    assert result.first_diff == pos
    assert result.original == [" N", "OR"] and result.reconstructed == [" NOR"]
    assert result.agreed_tokens == len(sampled) - 2


def test_literal_special_token_text_is_text_and_counted(fmt, enc):
    """A literal `<|im_end|>` that the model wrote as six text tokens passes through a provider as
    text and is rebuilt as text: exact (it was `special_token` when text was encoded with every
    special allowed). The report counts such samples either way."""
    body = fmt.codec.encode_ordinary_batch(["Say <|im_end|> now."])[0]
    assert body[2:6] == IM_END_AS_TEXT[2:]  # the model wrote the name as text
    ids = enc("r</think>") + body + [IM_END]
    result = _one(fmt, ids)
    assert result.cls == "exact" and result.literal_special == ("<|im_end|>",)
    report = validate_to_report(fmt, [InputRow("l", "x", ids), InputRow("m", "y", REFERENCE_IDS)])
    assert report["literal_special_text"] == {"samples": 1, "exact": 1, "names": {"<|im_end|>": 1}, "examples": ["x"]}


def test_tool_calls_exact_and_renumbered_ids_differ(fmt, enc):
    section = (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{{"a": 1}}'
        "<|tool_call_end|><|tool_call_begin|>functions.g:{n}<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )
    assert _one(fmt, enc("think</think>" + section.format(n=4))).cls == "exact"
    # The model numbered its second call 3 again: the server (and the rebuild) renumber it 4.
    renumbered = _one(fmt, enc("think</think>" + section.format(n=3)))
    assert renumbered.cls == "structure" and "'functions.g:3' rewritten by the server" in renumbered.detail


def test_truncation_inside_reasoning_and_content_is_exact(fmt, enc):
    ids = enc("A long line of thought</think>And an answer that goes on")
    for cut in (3, len(ids) - 2):
        assert _one(fmt, ids[:cut], "length").cls == "exact"


def test_truncation_inside_multibyte_char_is_unreconstructable(fmt, enc):
    """The provider's text ends in U+FFFD: the overflow path would exclude it, so the local gate
    says so (and it fails nothing: no such row reaches training data from the overflow side)."""
    ids = enc("r</think>emoji 🦜")
    tail = enc("🦜")
    assert len(tail) > 1, "needs a character spread over several tokens"
    result = _one(fmt, ids[:-1], "length")
    assert result.cls == "unreconstructable" and result.detail == "truncated inside a multi-byte character"
    assert result.first_diff == len(ids) - len(tail)


def test_local_cuts_that_the_overflow_path_would_exclude(fmt, enc):
    text = (
        "r</think>c<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    ids = enc(text)
    cut = _one(fmt, ids[:-4], "length", tools=TOOLS)
    assert cut.cls == "unreconstructable" and cut.detail.startswith("truncated")
    report = validate_to_report(fmt, [InputRow("l", "x", ids[:-4], "length", tools=TOOLS)])
    assert report["gate"]["passed"] and report["counts"]["unreconstructable"] == 1


def test_report_keys_counts_and_gate(fmt, enc):
    bpe = enc("x</think>A NOR B<|im_end|>")
    bpe = bpe[: bpe.index(93622)] + [575, 1292] + bpe[bpe.index(93622) + 1 :]
    rows = [InputRow(f"line {i}", f"s{i}", REFERENCE_IDS) for i in range(9)] + [InputRow("line 10", "s9", bpe)]
    report = validate_to_report(fmt, rows)
    assert set(report) == {
        "samples",
        "counts",
        "details",
        "sample_mismatch_rate",
        "token_agreement",
        "literal_special_text",
        "stop_convention",
        "mismatches",
        "bad_rows",
        "gate",
    }
    assert report["counts"] == {**dict.fromkeys(CLASSES, 0), "exact": 9, "bpe_only": 1}
    assert report["sample_mismatch_rate"] == pytest.approx(0.1)
    assert report["token_agreement"] == pytest.approx(1 - 2 / (9 * 12 + len(bpe)))
    assert report["mismatches"] == [
        {
            "sample_id": "s9",
            "class": "bpe_only",
            "first_diff": bpe.index(575),
            "original": [" N", "OR"],
            "reconstructed": [" NOR"],
            "detail": None,
        }
    ]
    assert report["gate"] == {"passed": True, "reasons": [], "warnings": []}
    assert report["stop_convention"]["convention"] == "included" and report["stop_convention"]["with_stop_id"] == 10
    strict = validate_to_report(fmt, rows, max_bpe_mismatch_rate=0.05)
    assert not strict["gate"]["passed"] and "bpe_only rate 0.1000 exceeds 0.05" in strict["gate"]["reasons"][0]
    special = validate_to_report(fmt, rows[:2] + [InputRow("l", "x", enc("a</think>b") + enc("</think>") + [IM_END])])
    assert special["gate"]["passed"] is False and special["counts"]["special_token"] == 1


def test_forked_workers_give_the_same_results(fmt, enc):
    rows = [
        InputRow(f"line {i}", f"s{i}", enc(f"step {i}</think>answer {'NOR ' * (i % 3)}<|im_end|>")) for i in range(40)
    ]
    literal = fmt.codec.encode_ordinary_batch(["</think>"])[0]
    rows[7] = InputRow(
        "line 8", "s7", enc("a") + literal + enc("b</think>c<|im_end|>")
    )  # literal "</think>" in reasoning
    serial = _run(fmt, rows, chunk_rows=6)
    forked = _run(fmt, rows, chunk_rows=6, workers=2)
    assert forked == serial
    assert [r.cls for r in forked].count("special_token") == 1


@pytest.mark.timeout(120)
def test_forked_workers_finish_under_a_host_sigterm_handler_that_does_not_exit(fmt, enc):
    """A host process (an Airflow task; pytest after dag.test) may hold a SIGTERM handler that does
    not exit, and forked workers inherit it: a pool that relied on SIGTERM to stop them hung a full
    run once. Workers must be reaped both after a complete run and after an early stop."""
    import multiprocessing
    import signal

    rows = [InputRow(f"line {i}", f"s{i}", enc(f"step {i}</think>answer<|im_end|>")) for i in range(12)]
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        stops = detect_stop_convention(fmt, rows)
        assert [r.cls for r in validate_rows(fmt, rows, stops=stops, chunk_rows=3, workers=2)] == ["exact"] * 12
        stopped_early = validate_rows(fmt, rows, stops=stops, chunk_rows=3, workers=2)
        assert next(stopped_early).cls == "exact"
        stopped_early.close()  # GeneratorExit inside the pool: workers must still be reaped
        for _ in range(5):  # a bad first row stops the pool while its workers are still starting
            bad_first = [BadRow("line 0", "s0", "output_ids", "missing")] + rows
            with pytest.raises(UserError, match="line 0"):
                list(validate_rows(fmt, bad_first, stops=stops, chunk_rows=3, workers=2))
        assert multiprocessing.active_children() == []
    finally:
        signal.signal(signal.SIGTERM, previous)


def _jsonl(path, lines):
    path.write_bytes(
        b"".join(
            (line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode())
            + b"\n"
            for line in lines
        )
    )
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


def test_bad_rows_fail_naming_row_and_field(fmt, tmp_path):
    path = _jsonl(tmp_path / "in.jsonl", BAD_LINES)
    with pytest.raises(UserError, match=r"line 2: field '<line>': invalid JSON"):
        validate_to_report(fmt, lambda: rows_from_file(path, VOCAB))


def test_bad_rows_skipped_and_listed_and_counted_against_the_gate(fmt, tmp_path):
    path = _jsonl(tmp_path / "in.jsonl", BAD_LINES)
    report = validate_to_report(fmt, lambda: rows_from_file(path, VOCAB), on_bad_row="skip")
    assert report["counts"]["exact"] == 2 and report["samples"] == 2
    assert (
        not report["gate"]["passed"]
        and "8 bad row(s) (80.00% of 10) exceed max_bad_row_rate 0.00%" in report["gate"]["reasons"]
    )
    lenient = validate_to_report(fmt, lambda: rows_from_file(path, VOCAB), on_bad_row="skip", max_bad_row_rate=0.9)
    assert lenient["gate"]["passed"]
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


def test_parquet_batches_and_validation_rows_table(fmt, tmp_path):
    table = pa.table(
        {
            "sample_id": ["a", "b", "c"],
            "output_ids": pa.array([REFERENCE_IDS, None, [5, 999999]], pa.list_(pa.int32())),
            "finish_reason": ["stop", "stop", "length"],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    stops = detect_stop_convention(fmt, rows_from_file(tmp_path / "in.parquet", VOCAB))
    items = list(
        validate_rows(fmt, rows_from_file(tmp_path / "in.parquet", VOCAB, batch_rows=2), stops=stops, on_bad_row="skip")
    )
    assert (
        list(
            validate_batches(
                fmt, pq.ParquetFile(tmp_path / "in.parquet").iter_batches(2), stops=stops, on_bad_row="skip"
            )
        )
        == items
    )
    assert isinstance(items[0], RowResult) and items[0].cls == "exact"
    assert [(b.where, b.sample_id, b.field) for b in items[1:]] == [
        ("row 2", "b", "output_ids"),
        ("row 3", "c", "output_ids"),
    ]
    out = validation_rows_table(items, dataset="demo", source="sglang")
    assert out.schema.names[:4] == ["sample_id", "dataset", "source", "class"]
    assert out.to_pylist()[0]["output_tokens"] == 12
    with pytest.raises(UserError, match="no column 'output_ids'"):
        list(rows_from_batches([pa.record_batch({"sample_id": ["x"]})], VOCAB))


def test_billing_deviation():
    ok = compare_billed_counts([("a", 1000, 1000), ("b", 2000, 2004)])
    assert ok["deviation"] == pytest.approx(4 / 3000) and ok["gate"]["passed"] is not False
    assert ok["worst_samples"][0]["sample_id"] == "b"
    bad = compare_billed_counts([("a", 1000, 1100)], max_aggregate_deviation=0.05)
    assert not bad["gate"]["passed"] and "+10.0000%" in bad["gate"]["reasons"][0]


def test_billing_excludes_unreconstructable_rows_and_still_gates_faithful_ones():
    cut = "truncated inside tool-call section"
    rows = [("a", 1000, 1000, None), ("b", 48, 30, cut), ("c", 48, 20, cut), ("d", 500, 500)]
    ok = compare_billed_counts(rows)
    assert ok["gate"]["passed"] and ok["deviation"] == 0.0 and ok["rows"] == 2
    assert ok["excluded"] == {"rows": 2, "billed_completion_tokens": 96, "reasons": {cut: 2}}
    assert ok["gate"]["notes"] == [
        f"2 row(s) excluded from the deviation and from training data, unreconstructable: {cut}"
    ]
    assert {w["sample_id"] for w in ok["worst_samples"]} == {"a", "d"}
    bad = compare_billed_counts([*rows, ("e", 1000, 900, None)])
    assert not bad["gate"]["passed"] and bad["excluded"]["rows"] == 2
    assert bad["deviation"] == pytest.approx(-100 / 2500)


# ---------------------------------------------------------------- the provider's view (issue 10)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}}}}}]


@pytest.mark.parametrize(
    ("text", "cls", "detail"),
    [
        # Kimi may end reasoning implicitly: the server's split then hands back a message whose
        # rebuild inserts a `</think>` the model never generated.
        (
            "I will call.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            '{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            "structure",
            "without </think>",
        ),
        # the tool regexes drop whitespace between section / call / argument tokens
        (
            "r</think><|tool_calls_section_begin|>\n<|tool_call_begin|> functions.f:0 <|tool_call_argument_begin|>"
            '{"a": 1}\n<|tool_call_end|>\n<|tool_calls_section_end|><|im_end|>',
            "structure",
            "dropped",
        ),
        # a generation that starts with <think>: the reasoning parser strips it
        ("<think>deep</think>answer<|im_end|>", "structure", "leading <think>"),
        # arguments that are not a JSON object: SGLang returns no call
        (
            "r</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            "[1, 2]<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
            "structure",
            "call dropped",
        ),
        (
            "r</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            "{a: 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
            "structure",
            "not valid JSON",
        ),
        # a tool section with no tools offered comes back as content text
        (
            "r</think>c<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            "{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
            "structure",
            "no tools offered",
        ),
        # the well-formed cases stay exact
        (
            "r</think>c<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
            '{"a": {"b": [1, "}"]}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            "exact",
            None,
        ),
        ("</think>just content<|im_end|>", "exact", None),
    ],
)
def test_the_gate_judges_what_the_provider_returns(fmt, enc, text, cls, detail):
    tools = [] if detail == "no tools offered" else TOOLS
    result = _one(fmt, enc(text), tools=tools)
    assert result.cls == cls, result
    assert (detail is None and result.detail is None) or detail in result.detail


def test_literal_think_end_in_reasoning_is_not_exact(fmt, enc):
    """SGLang splits reasoning at the *text* `</think>`: the model's literal one (ordinary tokens)
    ends the reasoning in the provider's answer, and the real one lands in the content."""
    literal = fmt.codec.encode_ordinary_batch(["</think>"])[0]
    result = _one(fmt, enc("about ") + literal + enc(" tags</think>answer<|im_end|>"))
    assert result.cls == "special_token"


def test_literal_section_begin_in_content_is_not_exact(fmt, enc):
    """A literal `<|tool_calls_section_begin|>` in content: the tool parser cuts the content there."""
    literal = fmt.codec.encode_ordinary_batch(["see <|tool_calls_section_begin|> here"])[0]
    result = _one(fmt, enc("r</think>") + literal + [IM_END], tools=TOOLS)
    assert result.cls != "exact" and result.literal_special == ("<|tool_calls_section_begin|>",)


def test_thinking_off_rows_validate_in_their_own_mode(kimi_fmt_off, fmt, enc):
    ids = enc("Just an answer.<|im_end|>")
    assert _one(kimi_fmt_off, ids).cls == "exact"
    assert _one(fmt, ids).cls != "exact"  # judged in the wrong mode, the rebuild adds a </think>


# ---------------------------------------------------------------- stop provenance (issue 10)


def test_a_wrong_stop_id_is_never_exact(fmt, enc):
    """163533 ("chas") where 163586 belongs, finish_reason stop: it was `exact` (the parser took the
    missing stop id for a stripped one and the rebuild appended <|im_end|>)."""
    body = enc("r</think>fine")
    rows = [InputRow(f"l{i}", f"s{i}", body + [IM_END], "stop") for i in range(5)]
    rows.append(InputRow("l9", "bad", body + [CHAS], "stop"))
    results = {r.sample_id: r for r in _run(fmt, rows)}
    assert results["s0"].cls == "exact" and results["s0"].stop == "id"
    bad = results["bad"]
    assert bad.cls == "wrong_stop" and "id 163533 ('chas')" in bad.detail and "include theirs" in bad.detail
    report = validate_to_report(fmt, rows)
    assert not report["gate"]["passed"] and "1 sample(s) classified wrong_stop" in report["gate"]["reasons"][0]


def test_a_server_stopping_on_the_wrong_id_fails_the_gate_naming_it(fmt, enc):
    """Every stop row ends with "chas": no row carries an audited stop id, so each alone looks
    like a stripped stop; across the dataset the same ordinary id ends them all and never occurs
    earlier in them: the gate fails naming it."""
    rows = [InputRow(f"l{i}", f"s{i}", enc(f"r{i}</think>answer {i}.") + [CHAS], "stop") for i in range(6)]
    report = validate_to_report(fmt, rows)
    assert report["stop_convention"]["dominant_token"] == {"id": CHAS, "text": "chas", "rows": 6}
    assert not report["gate"]["passed"]
    assert any(
        "end with id 163533 ('chas')" in r and "the server stops on 163533" in r for r in report["gate"]["reasons"]
    )


def test_stripped_stop_ids_pass_with_a_prominent_warning(fmt, enc):
    """No row carries a stop id and their last tokens vary or occur earlier ("." does): the
    convention is `stripped`, the rows are normalised, and the report says so."""
    rows = [InputRow(f"l{i}", f"s{i}", enc(f"r.</think>Answer {'x' * i}."), "stop") for i in range(5)]
    report = validate_to_report(fmt, rows)
    assert report["counts"]["exact"] == 5 and report["gate"]["passed"]
    assert report["stop_convention"]["convention"] == "stripped" and report["stop_convention"]["dominant_token"] is None
    assert report["gate"]["warnings"][0].startswith("stop ids stripped")


def test_stripped_stop_ids_of_mostly_tool_call_turns_pass(fmt, enc):
    """An engine that strips stop ids, on an agentic dataset: most stop rows are tool-call turns,
    which all end with `<|tool_calls_section_end|>` (163596). A structural token of the format is
    no evidence of a wrong stop id: it was read as "the server stops on 163596" and failed a clean
    dataset. The same dataset stopped on 163533 ("chas") still fails."""
    calls = [
        enc(
            f"r{i}</think>checking<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            f'<|tool_call_argument_begin|>{{"a": "c{i}"}}<|tool_call_end|><|tool_calls_section_end|>'
        )
        for i in range(8)
    ]
    assert all(c[-1] == fmt.special_ids["<|tool_calls_section_end|>"] == 163596 for c in calls)
    plain = [enc(f"r{i}.</think>Answer {'x' * i}.") for i in range(3)]
    rows = [InputRow(f"l{i}", f"s{i}", ids, "stop", tools=TOOLS) for i, ids in enumerate(calls + plain)]
    report = validate_to_report(fmt, rows)
    assert report["stop_convention"]["convention"] == "stripped" and report["stop_convention"]["dominant_token"] is None
    assert report["gate"]["passed"], report["gate"]
    assert report["counts"]["exact"] == len(rows)
    chas = [InputRow(f"l{i}", f"s{i}", ids + [CHAS], "stop", tools=TOOLS) for i, ids in enumerate(calls + plain)]
    report = validate_to_report(fmt, chas)
    assert report["stop_convention"]["dominant_token"]["id"] == CHAS and not report["gate"]["passed"]


def test_the_engines_matched_stop_wins(fmt, enc):
    body = enc("r</think>fine")
    assert _one(fmt, body, "stop", matched=IM_END).cls == "exact"  # reported, ids without it: normalised
    assert _one(fmt, body + [IM_END], "stop", matched=IM_END).stop == "matched"
    chas = _one(fmt, body + [CHAS], "stop", matched=CHAS)
    assert chas.cls == "wrong_stop" and "stopped on id 163533 ('chas'), not an audited stop id" in chas.detail
    text = _one(fmt, body, "stop", matched="\n\n")
    assert text.cls == "stop_string" and "'\\n\\n'" in text.detail
    length = _one(fmt, body + [IM_END], "length")
    assert length.cls == "wrong_stop" and "finish_reason length" in length.detail


def test_stop_provenance_is_read_from_the_generation_rows(fmt, enc):
    """The local generation rows carry the engine's finish_reason object in their provenance."""
    prov = json.dumps({"finish_reason": {"type": "stop", "matched": CHAS}})
    table = pa.table(
        {
            "sample_id": ["a"],
            "output_ids": pa.array([enc("r</think>x") + [CHAS]], pa.list_(pa.int32())),
            "finish_reason": ["stop"],
            "provenance": [prov],
            "tools": [None],
        }
    )
    [row] = list(rows_from_batches(table.to_batches(), VOCAB))
    assert (row.matched, row.tools, row.finish_reason) == (CHAS, [], "stop")
    assert _run(fmt, [row])[0].cls == "wrong_stop"


# ---------------------------------------------------------------- gates that cannot pass on nothing


def test_no_local_samples_fail_unless_the_dataset_allows_unvalidated_overflow(fmt):
    report = validate_to_report(fmt, [])
    assert not report["gate"]["passed"] and "no local samples to validate" in report["gate"]["reasons"][0]
    allowed = validate_to_report(fmt, [], allow_unvalidated_overflow=True)
    assert allowed["gate"]["passed"] and "UNVALIDATED" in allowed["gate"]["warnings"][0]


def test_missing_usage_is_counted_not_zero():
    """All-missing usage gave deviation 0 and passed."""
    rows = [("a", None, 100), ("b", None, 50)]
    report = compare_billed_counts(rows)
    assert report["rows"] == 0 and report["missing_usage"]["rows"] == 2 and report["missing_usage"]["rate"] == 1.0
    assert (
        not report["gate"]["passed"]
        and "2 row(s) (100.00%) have no usage.completion_tokens" in report["gate"]["reasons"][0]
    )
    some = compare_billed_counts([("a", 100, 100), ("b", None, 50)], max_missing_usage_rate=0.5)
    assert some["gate"]["passed"] and some["deviation"] == 0.0


def test_a_cut_right_after_think_end_is_a_prefix(fmt, enc):
    """The provider's answer cannot show a `</think>` generated as the very last token: the
    overflow rebuild is a strict prefix (never a wrong id). Counted, not exact, not failing."""
    ids = enc("thinking hard</think>")
    assert ids[-1] == THINK_END
    result = _one(fmt, ids, "length")
    assert result.cls == "prefix" and result.reconstructed_tokens == len(ids) - 1
    assert validate_to_report(fmt, [InputRow("l", "x", ids, "length")])["gate"]["passed"]


def test_workers_inside_a_daemonic_process_validate_in_process(fmt, enc, monkeypatch):
    """A Celery prefork worker runs Airflow tasks in a daemonic process, where a multiprocessing
    pool refuses to start ("daemonic processes are not allowed to have children"): the gate must
    still run there, in-process, with the same results. (The daemon flag is set on this process
    the way multiprocessing sets it in a daemonic child.)"""
    import multiprocessing

    rows = [InputRow(f"line {i}", f"s{i}", enc(f"step {i}</think>answer<|im_end|>")) for i in range(7)]
    stops = detect_stop_convention(fmt, rows)
    monkeypatch.setitem(multiprocessing.current_process()._config, "daemon", True)
    assert [r.cls for r in validate_rows(fmt, rows, stops=stops, chunk_rows=3, workers=2)] == ["exact"] * 7
    assert multiprocessing.active_children() == []


def test_prompt_billing_fails_a_systematic_gap_naming_the_rows_and_passes_an_exact_count():
    """14 extra billed prompt tokens per answer (a provider's own system prompt) passed the gate
    when only completion tokens were compared. Exact counts pass; a gap of 3 on every answer
    fails both the mean and the per-row check, the rows named with their gap; one answer off by
    one is within the tolerance; a missing count is missing, not 0."""
    exact = compare_billed_prompts([("a", 120, 120), ("b", 40, 40)])
    assert exact["gate"]["passed"] and exact["mean_abs_diff"] == 0.0 and exact["diff_distribution"] == [["0", 2]]
    gap = compare_billed_prompts([("a", 123, 120), ("b", 43, 40), ("c", 83, 80)])
    assert not gap["gate"]["passed"] and gap["mean_abs_diff"] == 3.0 and gap["diff_distribution"] == [["+3", 3]]
    mean, rows = gap["gate"]["reasons"]
    assert "3.00 tokens per answer" in mean and "max_prompt_billing_mean_abs_diff 1" in mean
    assert (
        rows.startswith("3 answer(s) (100.00%) billed more than 2 prompt tokens away")
        and "a (+3), b (+3), c (+3)" in rows
    )
    near = compare_billed_prompts([("a", 121, 120)] + [(f"r{i}", 50, 50) for i in range(9)])
    assert near["gate"]["passed"] and near["mean_abs_diff"] == 0.1
    tails = compare_billed_prompts([("a", 100, 114), ("b", 114, 100)], max_mean_abs_diff=20, max_row_diff=20)
    assert tails["gate"]["passed"] and tails["diff_distribution"] == [["<= -9", 1], [">= +9", 1]]
    missing = compare_billed_prompts([("a", None, 120), ("b", 40, 40)])
    assert missing["rows"] == 1 and missing["missing_usage"] == {"rows": 1, "rate": 0.5, "examples": ["a"]}
    assert missing["mean_abs_diff"] == 0.0 and not missing["gate"]["passed"]
    assert "have no usage.prompt_tokens" in missing["gate"]["reasons"][0]


def test_billed_zero_on_answers_fails_naming_the_rows_not_a_deviation_of_0():
    """Issue 55: a provider whose usage said 0 completion tokens on every row made the billed
    total 0 and the deviation 0.0, and the billing gate passed. A 0 billed for a non-empty answer
    (or prompt) is no count: named with the row count, left out of the comparison, gated like a
    missing count. An empty answer billed 0 is an honest count."""
    zeros = compare_billed_counts([(f"s{i}", 0, 40 + i) for i in range(5)])
    assert zeros["rows"] == 0 and zeros["zero_usage"]["rows"] == 5 and zeros["zero_usage"]["rate"] == 1.0
    assert not zeros["gate"]["passed"]
    (why,) = zeros["gate"]["reasons"]
    assert why.startswith("5 row(s) (100.00%) billed 0 completion_tokens for a non-empty answer")
    assert "(e.g. s0, s1, s2)" in why
    one = compare_billed_counts([("a", 100, 100), ("b", 0, 30), ("c", 0, 0)])
    assert not one["gate"]["passed"] and one["rows"] == 2 and one["deviation"] == 0.0
    assert one["zero_usage"] == {"rows": 1, "rate": 1 / 3, "examples": ["b"]}
    assert compare_billed_counts([("a", 100, 100), ("c", 0, 0)])["gate"]["passed"]
    prompt = compare_billed_prompts([("a", 0, 120), ("b", 0, 40)])
    assert prompt["rows"] == 0 and prompt["mean_abs_diff"] == 0.0 and not prompt["gate"]["passed"]
    (why,) = prompt["gate"]["reasons"]
    assert why.startswith("2 row(s) (100.00%) billed 0 prompt_tokens for a non-empty prompt") and "a, b" in why
