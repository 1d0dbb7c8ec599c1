"""The report view's library half against a real S3 (SeaweedFS): index, loading, numbers, HTML."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from html import escape

import pytest

from eagle3_data.errors import UserError
from eagle3_data.generation.routing import consistency_report
from eagle3_data.report_view import (
    RUN_REPORT_NAME,
    first_diff_histogram,
    generation_lengths,
    length_stats,
    load_run_report,
    render_html,
    run_key_for,
    run_report_ref,
    write_run_report,
)
from eagle3_data.storage import StageRef
from eagle3_data.validate import BadRow, RowResult, ValidationSummary, compare_billed_counts

RUN = "view-test"
EVIL = "<script>alert('x')</script>"
THRESHOLDS = {"max_bpe_mismatch_rate": 0.1, "max_text_diff_rate": 0.0, "max_billing_deviation": 0.01}


def validation_report(exact: int, bpe_positions: list[int]) -> dict:
    """A report as validate.py's producers write it (pipeline.validate adds run_gate)."""
    summary = ValidationSummary(THRESHOLDS["max_bpe_mismatch_rate"])
    for i in range(exact):
        summary.add(RowResult(f"ok-{i}", "exact", None, [], [], 100, 100, 100))
    for i, pos in enumerate(bpe_positions):
        summary.add(RowResult(f"tc-{i}", "bpe_only", pos, [" N", "OR", EVIL], [" NOR", EVIL], 200, 199, pos))
    summary.add(BadRow("row 7", "s-bad", "output_ids", "missing"))
    report = summary.report()
    gate = {**report["gate"], "thresholds": THRESHOLDS}
    return {**report, "run_gate": gate}


def calibration(tokenizer) -> dict:
    """A provider calibration as pipeline.validate writes it: same, BPE split, differing text (the
    provider's carries EVIL), failed on one path, unreconstructable (agreeing prefixes 12, 9, 8)."""
    text = "Let me think.</think>The answer is 42.<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    split = ids[:9] + tokenizer.encode("4", add_special_tokens=False) + tokenizer.encode("2", add_special_tokens=False) + ids[10:]
    over = {"status": "ok", "reasoning": "Let me think.", "content": "The answer is 42.", "tool_calls": None,
            "finish_reason": "stop", "messages": "[]"}
    local = [{"sample_id": s, "status": "ok", "output_ids": split if s == "bpe" else ids} for s in ("same", "bpe", "evil", "lost", "cut")]
    provider = [{**over, "sample_id": s} for s in ("same", "bpe")] + [
        {**over, "sample_id": "evil", "content": f"The answer is {EVIL}"},
        {**over, "sample_id": "lost", "status": "failed"},
        {**over, "sample_id": "cut", "finish_reason": "length", "status": "unreconstructable",
         "tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}])},
    ]
    return consistency_report(tokenizer, local, provider, first_n=64, sample_ids={"same", "bpe", "evil", "lost", "cut"})


@pytest.fixture
def run_report(store, kimi_tokenizer):
    """Two datasets: tool_calls (failed gate, overflow billing with 2 rows excluded, provider
    calibration, lengths, generation totals) and chat."""
    tc = StageRef(RUN, "validate", "tool_calls")
    chat = StageRef(RUN, "validate", "chat")
    cut = "truncated inside tool-call section"
    billing = compare_billed_counts(
        [(f"o-{i}", 3000 + i, 3000 + i + (3 if i == 4 else 0)) for i in range(13)]
        + [("x-0", 4096, 4000, cut), ("x-1", 4096, 3900, cut), ("x-2", 1000, 990, f"{EVIL} reason")],
        max_aggregate_deviation=0.01,
    )
    entries = {
        "tool_calls": {
            "validation": store.put_json(tc, "report.json", {
                **validation_report(42, [1, 3, 3, 40, 41, 130, 7, 9]), "calibration": calibration(kimi_tokenizer),
            }),
            "billing": store.put_json(tc, "billing.json", billing),
            "thresholds": THRESHOLDS,
            "lengths": {
                "prompt_tokens": length_stats([120, 340, 341, 900, 1500]),
                "output_tokens": length_stats([10, 2048, 777]),
            },
            "generation": {
                "local": {"ok": 37, "failed": 0, "prompt_tokens": 20000, "completion_tokens": 41000, "cost_usd": 0.0},
                "overflow": {"ok": 13, "failed": 1, "prompt_tokens": 7000, "completion_tokens": 39078, "cost_usd": 0.8731},
            },
        },
        "chat": {
            "validation": store.put_json(chat, "report.json", validation_report(33, [])),
            "thresholds": THRESHOLDS,
        },
    }
    return write_run_report(store, RUN, entries, dag_id="eagle3_datagen", run_id="manual__1")


def test_index_is_committed_where_the_view_looks(store, run_report):
    ref = run_report_ref(RUN)
    assert run_report == store.uri(ref, RUN_REPORT_NAME)
    assert store.is_complete(ref)
    assert store.get_json(ref, RUN_REPORT_NAME)["datasets"]["chat"]["validation"].endswith("/validate/chat/report.json")


def test_summary_has_the_numbers_written(store, run_report):
    report = load_run_report(store, RUN)
    by_name = {d["dataset"]: d for d in report.summary()["datasets"]}
    tc = by_name["tool_calls"]
    assert tc["samples"] == 50
    assert tc["counts"] == {"exact": 42, "bpe_only": 8, "special_token": 0, "text_diff": 0}
    assert tc["rates"]["bpe_only"] == pytest.approx(0.16)
    assert tc["sample_mismatch_rate"] == pytest.approx(0.16)
    assert tc["gate"]["passed"] is False and tc["bad_rows"] == 1
    assert tc["billing"]["billed_completion_tokens"] == 39078
    assert tc["billing"]["deviation"] == pytest.approx(3 / 39078)
    assert tc["billing"]["excluded"]["rows"] == 3 and tc["billing"]["excluded"]["billed_completion_tokens"] == 9192
    cal = tc["calibration"]
    assert (cal["samples"], cal["missing"], cal["unreconstructable"], cal["text_disagreements"]) == (3, 1, 1, ["evil"])
    assert cal["agreement"] == pytest.approx(1 / 3) and cal["text_agreement"] == pytest.approx(2 / 3)
    assert by_name["chat"]["calibration"] is None
    assert tc["generation"]["overflow"]["cost_usd"] == pytest.approx(0.8731)
    assert tc["thresholds"] == THRESHOLDS
    assert tc["lengths"]["prompt_tokens"] == {"count": 5, "mean": 640.2, "p50": 341, "p95": 1500, "max": 1500}
    assert sum(tc["first_diff_histogram"]["counts"]) == 8
    assert by_name["chat"]["gate"]["passed"] is True and by_name["chat"]["billing"] is None


def test_page_shows_numbers_charts_and_escaped_text(store, run_report):
    html = render_html(load_run_report(store, RUN), title="report <b>")
    assert "report &lt;b&gt;" in html
    assert EVIL not in html and escape(EVIL) in html  # model text never becomes markup
    assert "<script" not in html.lower()
    assert "16.00%" in html  # bpe_only rate
    assert "max 10.00%" in html  # its threshold marker
    assert "42 (84.0%)" in html  # exact bar label
    assert "39,078" in html and "39,081" in html and "0.008% (max ±1.00%)" in html  # billing
    assert "$0.8731" in html  # overflow cost
    assert "n=5, mean 640.2, p50 341, p95 1,500, max 1,500" in html
    assert len(re.findall(r"<svg ", html)) == 3 + 2 + 2  # 3 charts x 2 datasets - empty histogram + 2 lengths
    assert "gate <b>failed</b>" in html and "bpe_only rate 0.1600 exceeds 0.1" in html
    assert "Example diffs (8 of 8)" in html and "<span class='tok'>·NOR</span>" in html
    assert "http" not in html.replace("http://www.w3.org/2000/svg", "")  # no external assets


def test_page_shows_billing_exclusions_and_provider_calibration(store, run_report):
    html = render_html(load_run_report(store, RUN), title="t")
    assert EVIL not in html and "<script" not in html.lower()
    billing = html[html.index("Overflow billing check"):html.index("Provider calibration")]
    assert "<th>excluded, unreconstructable</th><td class='num'>3 rows, 9,192 tokens billed</td>" in billing
    assert "<th>reason: truncated inside tool-call section</th><td class='num'>2</td>" in billing
    assert f"<th>reason: {escape(EVIL)} reason</th><td class='num'>1</td>" in billing
    assert "2 row(s) excluded from the deviation and from training data, unreconstructable: truncated inside" in billing
    cal = html[html.index("Provider calibration"):html.index("Example diffs")]
    for label, value in [("samples compared", "3"), ("token agreement, first 64 ids", "33.33%"), ("text agreement", "66.67%"),
                         ("mean agreeing prefix (ids)", "9.7"), ("missing on a path", "1"), ("unreconstructable", "1")]:
        assert f"<th>{label}</th><td class='num'>{value}</td>" in cal
    assert "<tr class='bad'><th>text disagreements</th><td class='num'>1</td>" in cal
    assert "text differs from the engine's in 1 sample(s)" in cal
    rows = re.findall(r"<tr( class='bad')?><td><code>(\w+)</code></td><td class='num'>(\d+)</td>", cal)
    assert rows == [(" class='bad'", "evil", "8"), ("", "bpe", "9")]  # text disagreement first, highlighted
    assert escape("The answer is <script>alert") in cal and "same text (BPE split)" in cal
    assert "<b>Cannot prove:</b> that the provider serves the same weights" in cal and "<b>Can prove:</b>" in cal
    chat = html[html.index("<section id='ds-chat'>"):html.index("<section id='ds-tool_calls'>")]
    assert "Provider calibration" not in chat and "Overflow billing check" not in chat


def test_missing_artifact_is_reported_not_raised(store, run_report):
    store.client.delete_object(Bucket=store.bucket, Key=store.key(StageRef(RUN, "validate", "tool_calls"), "billing.json"))
    tc = next(d for d in load_run_report(store, RUN).datasets if d.name == "tool_calls")
    assert tc.billing is None and tc.validation is not None
    assert len(tc.errors) == 1 and "billing" in tc.errors[0] and "does not exist" in tc.errors[0]
    assert "billing.json does not exist" in render_html(load_run_report(store, RUN), title="t")


def test_generation_lengths_reads_ok_rows_of_generation_stages(store):
    local, rebuilt = StageRef(RUN, "generate_local", "chat"), StageRef(RUN, "reconstruct", "chat")
    rows = [
        {"sample_id": "a", "dataset": "chat", "prompt_ids": [1] * 10, "output_ids": [2] * 5, "status": "ok"},
        {"sample_id": "b", "dataset": "chat", "prompt_ids": [1] * 30, "output_ids": [2] * 50, "status": "ok"},
        {"sample_id": "c", "dataset": "chat", "prompt_ids": [1] * 99, "output_ids": [], "status": "failed"},
    ]
    for ref, part in ((local, rows[:2]), (rebuilt, rows[2:] + [{**rows[0], "sample_id": "d", "output_ids": [3] * 7}])):
        with store.writer(ref, "generations") as w:
            w.write(part)
            w.commit()
    lengths = generation_lengths(store, [local, rebuilt, StageRef(RUN, "generate_overflow", "chat")])
    assert lengths["prompt_tokens"]["count"] == 3 and lengths["prompt_tokens"]["max"] == 30
    assert lengths["output_tokens"]["mean"] == pytest.approx((5 + 50 + 7) / 3)


def test_missing_index_is_a_user_error(store):
    with pytest.raises(UserError, match="run_report.json does not exist"):
        load_run_report(store, "date=2020-01-01")


def test_index_refuses_uris_outside_the_store(store):
    with pytest.raises(UserError, match=r"datasets\.chat\.validation: 's3://elsewhere/x/report.json' is not an artifact"):
        write_run_report(store, RUN, {"chat": {"validation": "s3://elsewhere/x/report.json"}})
    with pytest.raises(UserError, match=r"datasets\.chat\.thresholds"):
        write_run_report(store, RUN, {"chat": {"validation": store.uri(StageRef(RUN, "validate", "chat"), "r.json"),
                                               "thresholds": {"max_text_diff_rate": "zero"}}})


def test_run_key_for():
    assert run_key_for({"run_name": "ablation-3"}, None) == "ablation-3"
    assert run_key_for({}, datetime(2026, 11, 29, tzinfo=timezone.utc)) == "date=2026-11-29"
    tz = timezone(timedelta(hours=9))  # 2026-11-30 08:00 in Tokyo is still the 29th in UTC
    assert run_key_for(None, datetime(2026, 11, 30, 8, tzinfo=tz)) == "date=2026-11-29"
    with pytest.raises(UserError, match="run_name"):
        run_key_for({"run_name": "../etc"}, None)
    with pytest.raises(UserError, match="manual run needs a run_name"):
        run_key_for({}, None)


def test_length_stats_and_histogram():
    st = length_stats(list(range(1, 101)), bins=10)
    assert (st["count"], st["p50"], st["p95"], st["max"], st["mean"]) == (100, 50, 95, 100, 50.5)
    assert st["counts"] == [10] * 10 and st["edges"][0] == 1 and st["edges"][-1] == 101
    assert length_stats([])["count"] == 0
    hist = first_diff_histogram([{"first_diff": 0}, {"first_diff": 0}, {"first_diff": 5}, {"first_diff": None}], bins=2)
    assert sum(hist["counts"]) == 3 and hist["counts"][0] == 2


def test_cli_renders_the_report(store, run_report, s3_server, tmp_path, monkeypatch, capsys):
    import yaml

    from eagle3_data.cli import main
    from eagle3_data.config import DEFAULT_CONFIG_PATH

    cfg = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    cfg["storage"] = {"bucket": store.bucket, "prefix": store.prefix}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    common = ["--config", str(tmp_path / "pipeline.yaml"), "--endpoint-url", s3_server.endpoint_url]
    assert main(["report", "--run-key", RUN, "--format", "json", "--out", str(tmp_path / "r.json"), *common]) == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    assert [d["dataset"] for d in summary["datasets"]] == ["chat", "tool_calls"]
    assert summary["datasets"][1]["counts"]["bpe_only"] == 8
    assert main(["report", "--run-key", RUN, *common]) == 0
    assert "Example diffs (8 of 8)" in capsys.readouterr().out
    assert main(["report", "--run-key", "nope", *common]) == 2
    assert "runs/nope/report/run/run_report.json does not exist" in capsys.readouterr().err


def test_examples_show_the_worst_classes_first():
    from eagle3_data.report_view import DatasetReport, RunReport

    mismatches = [{"sample_id": f"b{i}", "class": "bpe_only", "first_diff": i, "original": ["a"], "reconstructed": ["b"]}
                  for i in range(25)]
    mismatches.append({"sample_id": "t0", "class": "text_diff", "first_diff": 3, "original": ["é"], "reconstructed": ["\ufffd"]})
    validation = {"samples": 100, "counts": {"exact": 74, "bpe_only": 25, "text_diff": 1}, "mismatches": mismatches}
    html = render_html(RunReport("k", {}, [DatasetReport("chat", validation=validation)]), title="t")
    assert "Example diffs (20 of 26)" in html and "6 more not shown" in html
    examples = html[html.index("Example diffs"):]
    assert examples.index("<code>t0</code>") < examples.index("<code>b0</code>")
