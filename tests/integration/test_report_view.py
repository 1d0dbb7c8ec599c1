"""The report's library half against a real S3 (SeaweedFS): index, loading, numbers, HTML, Markdown."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest
from markupsafe import escape

from eagle3_data.errors import UserError
from eagle3_data.report import (
    RUN_REPORT_NAME,
    DatasetReport,
    RunReport,
    first_diff_histogram,
    generation_lengths,
    length_stats,
    load_run_report,
    render_html,
    render_markdown,
    run_report_ref,
    write_run_report,
)
from eagle3_data.run_key import run_key_for
from eagle3_data.stages.validate import (
    CLASSES,
    BadRow,
    RowResult,
    ValidationSummary,
    compare_billed_counts,
    compare_billed_prompts,
)
from eagle3_data.stages.validate.consistency import consistency_report
from eagle3_data.storage import StageRef
from eagle3_data.storage.writer import StageWriter

RUN = "view-test"
EVIL = "<script>alert('x')</script>"
THRESHOLDS = {
    "max_bpe_mismatch_rate": 0.1,
    "max_text_diff_rate": 0.0,
    "max_billing_deviation": 0.01,
    "max_bad_row_rate": 0.05,
}


def validation_report(exact: int, bpe_positions: list[int]) -> dict:
    """A report as validate.py's producers write it (pipeline.validate adds run_gate)."""
    summary = ValidationSummary(THRESHOLDS["max_bpe_mismatch_rate"], max_bad_row_rate=THRESHOLDS["max_bad_row_rate"])
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
    split = (
        ids[:9]
        + tokenizer.encode("4", add_special_tokens=False)
        + tokenizer.encode("2", add_special_tokens=False)
        + ids[10:]
    )
    over = {
        "status": "ok",
        "reasoning": "Let me think.",
        "content": "The answer is 42.",
        "tool_calls": None,
        "finish_reason": "stop",
        "messages": "[]",
    }
    local = [
        {"sample_id": s, "status": "ok", "output_ids": split if s == "bpe" else ids}
        for s in ("same", "bpe", "evil", "lost", "cut")
    ]
    provider = [{**over, "sample_id": s} for s in ("same", "bpe")] + [
        {**over, "sample_id": "evil", "content": f"The answer is {EVIL}"},
        {**over, "sample_id": "lost", "status": "failed"},
        {
            **over,
            "sample_id": "cut",
            "finish_reason": "length",
            "status": "unreconstructable",
            "tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        },
    ]
    from eagle3_data.chat_format import get_output_format

    fmt = get_output_format(tokenizer, thinking=True)
    return consistency_report(fmt, local, provider, first_n=64, sample_ids={"same", "bpe", "evil", "lost", "cut"})


EVIL_ANSWER = f"The answer is {EVIL}"
PAIRS = [(-0.30, -0.30), (-0.32, -0.33), (-0.31, -0.29)]  # calibration pairs' (local, overflow) means


def provider_checks(tokenizer) -> dict:
    """Identity and policy as pipeline.validate writes them: 1 of 13 answers from another provider;
    12 local and 12 overflow samples, the overflow ones 1 nat/token less likely (off policy), the
    least likely of them EVIL_ANSWER's ids; 3 calibration pairs (PAIRS); the worst samples as
    pipeline.score_policy decodes them, with the real Kimi tokenizer."""
    from eagle3_data.nucleus import Item
    from eagle3_data.policy_check import Thresholds, policy_gate, summarize, worst_samples
    from eagle3_data.stages.validate import identity_report

    rows = [
        {
            "sample_id": f"o-{i}",
            "status": "identity_mismatch" if i == 0 else "ok",
            "error": "provider Other Cloud is not the pin moonshotai" if i == 0 else None,
            "provenance": json.dumps(
                {"model": "moonshotai/kimi-k2.5", "provider": "Other Cloud" if i == 0 else "Moonshot AI"}
            ),
        }
        for i in range(13)
    ]
    evil = tuple(tokenizer.encode(EVIL_ANSWER, add_special_tokens=False))
    items = [
        Item(f"{side}-{i}", side, side, (1,) + (evil if (side, i) == ("overflow", 11) else (2, 3, 4)), 1)
        for side in ("local", "overflow")
        for i in range(12)
    ]
    scores = [
        [-0.2 - 0.01 * (i % 12) - (1.0 if it.side == "overflow" else 0.0)] * (len(it.ids) - 1)
        for i, it in enumerate(items)
    ]
    for i, pair in enumerate(PAIRS):
        for side, mean in zip(("local", "overflow"), pair):
            items.append(Item(f"c-{i}", side, "both", (1, 5, 6), 1))
            scores.append([mean] * 2)
    figures = {**summarize(items, scores, {}), "worst": worst_samples(items, scores, tokenizer.decode)}
    policy = policy_gate(figures, Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9))
    return {"identity": identity_report(rows), "policy": {**policy, "figures": figures}}


def extraction_logprobs(tokenizer) -> dict:
    """The extraction's figures as publish writes them: LogprobStats (their producer) over two
    local and two overflow answers, the least likely overflow one EVIL_ANSWER's ids, decoded."""
    import torch

    from eagle3_data.report.data import decode_least_likely
    from eagle3_data.stages.hidden_states.extract import _logprob_totals  # the shards' figures added up, as committed
    from eagle3_data.target_head.logprobs import LogprobStats

    stats = LogprobStats()
    answers = {
        ("vllm", "l-0"): "Hello there.",
        ("vllm", "l-1"): "Fine.",
        ("openrouter", "o-0"): "Sure.",
        ("openrouter", "o-1"): EVIL_ANSWER,
    }
    for (source, sid), text in answers.items():
        ids = [1] + tokenizer.encode(text, add_special_tokens=False)
        mean = -9.0 if sid == "o-1" else -1.0
        stats.add(
            sid, torch.tensor([float("nan")] + [mean] * (len(ids) - 1)), [0] + [1] * (len(ids) - 1), source, ids=ids
        )
    return decode_least_likely(_logprob_totals([{"logprobs": stats.summary()}])["logprobs"], lambda: tokenizer)


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
    # the prompt side: 12 answers billed 14 tokens more than their prompt ids, one exact, one without a count
    billing["prompt"] = compare_billed_prompts(
        [(f"o-{i}", 214 + i, 200 + i) for i in range(12)] + [("o-12", 90, 90), (EVIL, None, 80)],
        max_missing_usage_rate=0.5,
    )
    entries = {
        "tool_calls": {
            "validation": store.put_json(
                tc,
                "report.json",
                {
                    **validation_report(42, [1, 3, 3, 40, 41, 130, 7, 9]),
                    "calibration": calibration(kimi_tokenizer),
                    **provider_checks(kimi_tokenizer),
                },
            ),
            "billing": store.put_json(tc, "billing.json", billing),
            "thresholds": THRESHOLDS,
            "lengths": {
                "prompt_tokens": length_stats([120, 340, 341, 900, 1500]),
                "output_tokens": length_stats([10, 2048, 777]),
            },
            "generation": {
                "local": {"ok": 37, "failed": 0, "prompt_tokens": 20000, "completion_tokens": 41000, "cost_usd": 0.0},
                "overflow": {
                    "ok": 13,
                    "failed": 1,
                    "prompt_tokens": 7000,
                    "completion_tokens": 39078,
                    "cost_usd": 0.8731,
                },
                "trajectories": {
                    "trajectory_samples": 10,
                    "trajectory_samples_whole": 8,
                    "trajectory_samples_cut": 1,
                    "trajectory_cut_unreconstructable": 1,
                    "trajectory_samples_dropped": 1,
                    "trajectory_dropped_failed": 1,
                    "trajectory_turns": 14,
                    "trajectory_turns_folded": 4,
                    "trajectory_turns_record": 9,
                    "trajectory_turns_dropped": 1,
                },
            },
        },
        "chat": {
            "validation": store.put_json(chat, "report.json", validation_report(33, [])),
            "thresholds": THRESHOLDS,
        },
    }
    training = {
        "draft_vocab": {
            "size": 32000,
            "requested_size": 32000,
            "trained_tokens": 1_200_000,
            "distinct_trained": 41_000,
            "coverage": 0.9612,
        },
        "hidden_states_estimate": {
            "hidden_size": 7168,
            "tokens": 2_000_000,
            "bytes": {"shards_bf16": 114_698_000_000, "shards_fp8": 71_700_000_000},
        },
        "hidden_states_bytes": 114_000_000_000,
        "logprobs": extraction_logprobs(kimi_tokenizer),
    }
    return write_run_report(store, RUN, entries, dag_id="eagle3_datagen", run_id="manual__1", training=training)


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
    assert tc["counts"] == {**dict.fromkeys(CLASSES, 0), "exact": 42, "bpe_only": 8}  # every class the gate has
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
    # 3 charts x 2 datasets - empty histogram + 2 lengths + the policy check's 2 paths, twice (scored, every row)
    assert len(re.findall(r"<svg ", html)) == 3 + 2 + 2 + 2 + 2
    assert "gate <b>failed</b>" in html and "bpe_only rate 0.1600 exceeds 0.1" in html
    assert "Example diffs (8 of 8)" in html and "<span class='tok'>·NOR</span>" in html
    assert "http" not in html.replace("http://www.w3.org/2000/svg", "")  # no external assets


def test_page_shows_billing_exclusions_and_provider_calibration(store, run_report):
    html = render_html(load_run_report(store, RUN), title="t")
    assert EVIL not in html and "<script" not in html.lower()
    billing = html[html.index("Overflow billing check") : html.index("Provider calibration")]
    assert "<th>excluded, unreconstructable</th><td class='num'>3 rows, 9,192 tokens billed</td>" in billing
    assert "<th>reason: truncated inside tool-call section</th><td class='num'>2</td>" in billing
    assert f"<th>reason: {escape(EVIL)} reason</th><td class='num'>1</td>" in billing
    assert "2 row(s) excluded from the deviation and from training data, unreconstructable: truncated inside" in billing
    cal = html[html.index("Provider calibration") : html.index("Example diffs")]
    for label, value in [
        ("samples compared", "3"),
        ("token agreement, first 64 ids", "33.33%"),
        ("text agreement", "66.67%"),
        ("mean agreeing prefix (ids)", "9.7"),
        ("missing on a path", "1"),
        ("unreconstructable", "1"),
    ]:
        assert f"<th>{label}</th><td class='num'>{value}</td>" in cal
    assert "<tr class='bad'><th>text disagreements</th><td class='num'>1</td>" in cal
    assert "text differs from the engine's in 1 sample(s)" in cal
    rows = re.findall(r"<tr( class='bad')?><td><code>(\w+)</code></td><td class='num'>(\d+)</td>", cal)
    assert rows == [(" class='bad'", "evil", "8"), ("", "bpe", "9")]  # text disagreement first, highlighted
    assert escape("The answer is <script>alert") in cal and "same text (BPE split)" in cal
    assert "<b>Cannot prove:</b> that the provider serves the same weights" in cal and "<b>Can prove:</b>" in cal
    chat = html[html.index("<section id='ds-chat'>") : html.index("<section id='ds-tool_calls'>")]
    assert "Provider calibration" not in chat and "Overflow billing check" not in chat


def test_page_and_summary_show_identity_and_policy(store, run_report):
    report = load_run_report(store, RUN)
    tc = {d["dataset"]: d for d in report.summary()["datasets"]}["tool_calls"]
    assert (tc["identity"]["answered"], tc["identity"]["mismatched"], tc["identity"]["passed"]) == (13, 1, False)
    assert tc["policy"]["passed"] is False and tc["policy"]["gap_nats_per_token"] == pytest.approx(1.0)
    assert tc["policy"]["overflow"]["samples"] == 12
    html = render_html(report, title="t")
    part = html[html.index("Provider identity and policy") : html.index("Provider calibration")]
    assert "<tr class='bad'><th>not the pinned model/provider</th><td class='num'>1 (7.69%)</td>" in part
    assert "<th>served by moonshotai/kimi-k2.5 @ Moonshot AI</th><td class='num'>12</td>" in part
    assert "<tr class='bad'><th>policy gap (nats/token, local minus overflow)</th><td class='num'>1.0000</td>" in part
    assert "overflow text is off the target&#39;s policy" in part
    # the policy statement: 12 + 12 samples cannot see 0.1 nats/token with 90% power (their spread 0.035)
    statement = part[part.index("The policy check in sentences:") :].split("</p>")[0]
    assert "The sampled answers test (12 + 12 samples, local + overflow) measured a shift of" in statement
    assert "more than the 0.1000 that matters: UNDERPOWERED" in statement
    assert "policy UNDERPOWERED" not in part and "policy power:" not in part  # said once: in the statement
    assert "1x provider Other Cloud is not the pin moonshotai" in part
    md = render_markdown(report)
    assert "| not the pinned model/provider | 1 (7.69%) **(fails)** |" in md
    chat = html[html.index("<section id='ds-chat'>") : html.index("<section id='ds-tool_calls'>")]
    assert "Provider identity and policy" not in chat


def test_page_shows_the_policy_distributions_pairs_power_and_least_likely_answers(store, run_report, kimi_tokenizer):
    report = load_run_report(store, RUN)
    html = render_html(report, title="t")
    part = html[html.index("Provider identity and policy") : html.index("Provider calibration")]
    # one histogram per path, every sample in one bar, the overflow mass 1 nat/token lower (disjoint)
    bars = {
        side: [
            (float(lo), float(hi), int(n))
            for lo, hi, n in re.findall(
                r"<title>\[([-\d.e]+), ([-\d.e]+)[)\]]: (\d+)</title>",  # the last bin holds its upper edge
                part[part.index(f"({side}: 12 samples") :][:6000].split("</svg>")[0],
            )
        ]
        for side in ("local", "overflow")
    }
    assert {side: sum(n for _, _, n in b) for side, b in bars.items()} == {"local": 12, "overflow": 12}
    assert max(hi for _, hi, n in bars["overflow"] if n) <= min(lo for lo, _, n in bars["local"] if n)
    # the calibration pairs, local minus overflow
    for i, (lo, ov) in enumerate(PAIRS):
        assert (
            f"<tr><td><code>c-{i}</code></td><td class='num'>{lo:.4f}</td><td class='num'>{ov:.4f}</td>"
            f"<td class='num'>{lo - ov:.4f}</td></tr>" in part
        )
    power = part[part.index("The policy check in sentences:") :].split("</p>")[0]
    assert "The sampled answers test (12 + 12 samples, local + overflow)" in power
    assert "The calibration pairs (same prompt, greedy) test (3 pairs) measured" in power
    # the least likely overflow answer first, its ids decoded by the real tokenizer, escaped
    worst = part[part.index("Least likely overflow answers") :].split("</details>")[0]
    assert worst.index("<code>overflow-11</code>") < worst.index("<code>overflow-10</code>")
    pieces = re.findall(r"<span class='tok' title='[-\d.]+'>([^<]*)</span>", worst.split("<code>overflow-10</code>")[0])
    assert str(escape(EVIL_ANSWER.replace(" ", "·"))) == "".join(pieces)  # tok filter: spaces as ·
    assert EVIL not in html
    md = render_markdown(report)
    assert "The policy check in sentences: The sampled answers test (12 + 12 samples, local + overflow)" in md
    line = md[md.index("Least likely overflow answers under the target: ") :].split("\n")[0]
    assert line.startswith("Least likely overflow answers under the target: `overflow-11` -1.3100 (The answer is &lt;")
    assert "<script" not in line  # outside a code span: `<` cannot open raw HTML


def test_page_shows_every_rows_distributions_and_least_likely_samples_decoded(store, run_report):
    html = render_html(load_run_report(store, RUN), title="t")
    block = html[html.index("Target log-probabilities of the trained tokens") : html.index("<table class='overview'>")]
    assert "(openrouter: 2 samples)" in block and "(vllm: 2 samples)" in block  # one histogram per path
    worst = block[block.index("Least likely openrouter samples") :].split("</details>")[0]
    assert worst.index("<code>o-1</code> mean <b>-9.0000</b>") < worst.index("<code>o-0</code>")
    pieces = re.findall(r"<span class='tok' title='-9.0000'>([^<]*)</span>", worst)
    assert "".join(pieces) == str(escape(EVIL_ANSWER.replace(" ", "·")))  # decoded by the real tokenizer, escaped
    assert EVIL not in html


def test_page_states_the_draft_vocabulary_and_the_states_bytes(store, run_report):
    html = render_html(load_run_report(store, RUN), title="t")
    line = html[html.index("Draft vocabulary") : html.index("<table class='overview'>")]
    assert (
        "<b>32,000</b> tokens (N = 32,000) cover\n<b>96.12%</b> of the 1,200,000 trained tokens (41,000 distinct)"
        in line
    )
    assert "Hidden states at H = 7168: about 115 GB in bf16 shards\n(71.7 GB fp8), 114 GB written." in line


def test_missing_artifact_is_reported_not_raised(store, run_report):
    store.client.delete_object(
        Bucket=store.bucket, Key=store.key(StageRef(RUN, "validate", "tool_calls"), "billing.json")
    )
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
        with StageWriter(store, ref, "generations") as w:
            w.write(part)
            w.commit()
    lengths = generation_lengths(store, [local, rebuilt, StageRef(RUN, "generate_overflow", "chat")])
    assert lengths["prompt_tokens"]["count"] == 3 and lengths["prompt_tokens"]["max"] == 30
    assert lengths["output_tokens"]["mean"] == pytest.approx((5 + 50 + 7) / 3)


def test_missing_index_is_a_user_error(store):
    with pytest.raises(UserError, match="run_report.json does not exist"):
        load_run_report(store, "date=2020-01-01")


def test_index_refuses_uris_outside_the_store(store):
    with pytest.raises(
        UserError, match=r"datasets\.chat\.validation: 's3://elsewhere/x/report.json' is not an artifact"
    ):
        write_run_report(store, RUN, {"chat": {"validation": "s3://elsewhere/x/report.json"}})
    with pytest.raises(UserError, match=r"datasets\.chat\.thresholds"):
        write_run_report(
            store,
            RUN,
            {
                "chat": {
                    "validation": store.uri(StageRef(RUN, "validate", "chat"), "r.json"),
                    "thresholds": {"max_text_diff_rate": "zero"},
                }
            },
        )


def test_run_key_for():
    assert run_key_for({"run_name": "ablation-3"}, None) == "ablation-3"
    assert run_key_for({}, datetime(2026, 11, 29, tzinfo=timezone.utc)) == "date=2026-11-29"
    tz = timezone(timedelta(hours=9))  # 2026-11-30 08:00 in Tokyo is still the 29th in UTC
    assert run_key_for(None, datetime(2026, 11, 30, 8, tzinfo=tz)) == "date=2026-11-29"
    with pytest.raises(UserError, match="run_name"):
        run_key_for({"run_name": "../etc"}, None)
    with pytest.raises(UserError, match="manual run needs a run_name"):
        run_key_for({}, None)
    # a REST trigger without a logical date: its run id, made a key segment (the report view finds it)
    assert run_key_for({}, None, "manual__2026-12-01T10:00:00.123+00:00") == "manual__2026-12-01T10-00-00.123+00-00"


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
    assert main(["report", "--run-key", RUN, "--format", "markdown", *common]) == 0
    assert "## tool_calls\n\n**Gate: FAILED**" in capsys.readouterr().out
    assert main(["report", "--run-key", "nope", *common]) == 2
    assert "runs/nope/report/run/run_report.json does not exist" in capsys.readouterr().err


def test_examples_show_the_worst_classes_first():
    mismatches = [
        {"sample_id": f"b{i}", "class": "bpe_only", "first_diff": i, "original": ["a"], "reconstructed": ["b"]}
        for i in range(25)
    ]
    mismatches.append(
        {"sample_id": "t0", "class": "text_diff", "first_diff": 3, "original": ["é"], "reconstructed": ["\ufffd"]}
    )
    validation = {"samples": 100, "counts": {"exact": 74, "bpe_only": 25, "text_diff": 1}, "mismatches": mismatches}
    html = render_html(RunReport("k", {}, [DatasetReport("chat", validation=validation)]), title="t")
    assert "Example diffs (20 of 26)" in html and "6 more not shown" in html
    examples = html[html.index("Example diffs") :]
    assert examples.index("<code>t0</code>") < examples.index("<code>b0</code>")


def test_every_untrusted_string_is_escaped_by_the_templates():
    """Autoescape, not hand escaping: metacharacters in any field the page prints stay text."""
    evil = "<img src=x onerror=alert(1)>&\"'"
    mismatch = {"sample_id": evil, "class": evil, "first_diff": evil, "original": [evil], "reconstructed": evil}
    validation = {
        "samples": 2,
        "counts": {"exact": 1, "text_diff": 1},
        "mismatches": [mismatch],
        "bad_rows": [],
        "gate": {"passed": False, "reasons": [evil]},
        "calibration": {
            "first_n": 8,
            "samples": 1,
            "agreement": 0.0,
            "text_agreement": 0.0,
            "text_disagreements": [evil],
            "per_sample": [
                {"sample_id": evil, "first_diff": 0, "same_text": False, "engine_text": evil, "provider_text": evil}
            ],
            "can_prove": evil,
            "cannot_prove": evil,
        },
    }
    billing = {
        "rows": 1,
        "deviation": 0.0,
        "worst_samples": [{"sample_id": evil}],
        "gate": {"notes": [evil]},
        "excluded": {"rows": 1, "reasons": {evil: 1}},
    }
    dataset = DatasetReport(
        evil, validation=validation, billing=billing, errors=[evil], lengths={evil: length_stats([1, 2])}, thresholds={}
    )
    html = render_html(RunReport(evil, {"created_at": evil}, [dataset]), title=evil)
    assert "<img" not in html and evil not in html
    assert html.count(str(escape(evil))) >= 15  # title x2, run key, created_at, name x3, error, reason, ...
    assert str(escape(evil)) == "&lt;img src=x onerror=alert(1)&gt;&amp;&#34;&#39;"
    from eagle3_data.report import render_missing, render_unavailable

    for page in (render_missing(evil, evil, title=evil), render_unavailable(evil, evil, title=evil)):
        assert "<img" not in page and page.count(str(escape(evil))) == 4


def test_a_class_the_gate_adds_shows_up_everywhere(monkeypatch):
    """The report reads validate.CLASSES, so a new class needs no edit to the report or templates."""
    from eagle3_data.stages import validate

    assert "novel_class" not in validate.CLASSES
    monkeypatch.setattr(validate, "CLASSES", (*validate.CLASSES, "novel_class"))
    mismatches = [
        {
            "sample_id": "s0",
            "class": "novel_class",
            "first_diff": 4,
            "original": ["<|tool_call_begin|>"],
            "reconstructed": ["<|tool_calls_section_begin|>"],
        },
        {"sample_id": "b0", "class": "bpe_only", "first_diff": 2, "original": [" N", "OR"], "reconstructed": [" NOR"]},
    ]
    validation = {
        "samples": 10,
        "counts": {"exact": 7, "bpe_only": 1, "novel_class": 2},
        "mismatches": mismatches,
        "gate": {"passed": False, "reasons": ["2 sample(s) classified novel_class"]},
    }
    report = RunReport(
        "k", {}, [DatasetReport("chat", validation=validation, thresholds={"max_bpe_mismatch_rate": 0.1})]
    )
    (summary,) = report.summary()["datasets"]
    assert summary["counts"]["novel_class"] == 2 and summary["rates"]["novel_class"] == pytest.approx(0.2)
    html = render_html(report, title="t")
    assert "<th class='up'><span>novel_class</span></th>" in html  # overview column (written upwards: fits the tab)
    assert "text-anchor='end'>novel_class</text>" in html and "2 (20.0%)" in html  # class bars
    assert html.count(">novel_class</text>") == 2 and "20.00%" in html  # and its rate against the gate
    examples = html[html.index("Example diffs") :]
    assert ">novel_class</span> <code>s0</code>" in examples and examples.index("s0") < examples.index("b0")
    assert "| novel_class | 2 |" in render_markdown(report, title="t")


def test_markdown_comes_from_the_same_data(store, run_report):
    report = load_run_report(store, RUN)
    md = render_markdown(report, title="Run <b>")
    assert md.startswith("# Run <b>\n\n## Verdict\n\nNo stand-ins.\n\n| dataset | check | verdict | why |\n")
    assert "\nRun key `view-test`" in md
    chat, tool_calls = md.index("\n## chat\n"), md.index("\n## tool_calls\n")
    assert chat < tool_calls and "**Gate: PASSED**" in md[chat:tool_calls]
    tc = md[tool_calls:]
    assert "**Gate: FAILED**\n- bpe_only rate 0.1600 exceeds 0.1\n" in tc
    assert "Samples: 50; sample mismatch rate 16.0000%; token agreement" in tc
    assert "| bpe_only | 8 |" in tc and "| completion tokens billed | 39,078 |" in tc
    assert f"| reason: {EVIL.replace('<', '&lt;')} reason | 1 |" in tc  # no raw HTML outside code spans
    assert tc.count("| bpe_only | ") == 1 + 8 and "### Bad rows (skipped)" in tc
    bare = render_markdown(report.datasets[1].validation)  # what `eagle3-data validate` writes beside its JSON
    assert bare.startswith("# Reconstruction validation\n\n## Verdict\n\n| dataset | check | verdict | why |\n")
    assert "| this dataset | gate (bulk mismatch validation) | 🔴 **FAIL** |" in bare
    assert "\n**Gate: FAILED**" in bare and "## Mismatches" in bare


# The width of the Airflow run page's frame that shows the report (the Validation report tab),
# for a browser window of 1280 and 1400 px (Airflow 3.3: the nav bar and the grid beside it take
# the rest; measured in headless Chromium, as tests/cluster/test_browser.py does end to end).
TAB_FRAME_PX = {1280: 936, 1400: 1032}


@pytest.mark.parametrize("window", sorted(TAB_FRAME_PX))
def test_overview_fits_the_airflow_tab(store, run_report, tmp_path, window):
    """Every column of the overview, the gate's included, is visible without scrolling sideways in
    the frame the Airflow tab gives the page at a 1280 or 1400 px window: the table fitted a bare
    1280 px page, yet scrolled sideways inside the tab at 1400 px (1126 px of table in 1032)."""
    from tests.cluster.browser import Browser

    page = tmp_path / "report.html"
    page.write_text(render_html(load_run_report(store, RUN), title="t"))
    browser = Browser(window=(TAB_FRAME_PX[window], 900))
    try:
        browser.goto(page.as_uri())
        browser.wait_for("document.querySelector('table.overview') !== null", "the overview table")
        fit = browser.js("""(() => {
          const t = document.querySelector('table.overview'), gate = t.querySelector('span.gate');
          return {right: t.getBoundingClientRect().right, gate: gate.getBoundingClientRect().right,
                  view: document.documentElement.clientWidth, scroll: document.documentElement.scrollWidth};
        })()""")
    finally:
        browser.close()
    assert fit["view"] <= TAB_FRAME_PX[window] and fit["right"] <= fit["view"] and fit["gate"] <= fit["view"], fit
    assert fit["scroll"] <= fit["view"], fit  # nothing else overflows either


def test_page_shows_prompt_billing_and_what_the_merge_made_of_the_trajectories(store, run_report):
    report = load_run_report(store, RUN)
    html = render_html(report, title="t")
    assert EVIL not in html
    prompt = html[html.index("Overflow prompt billing") : html.index("Provider identity and policy")]
    for label, value in [
        ("answers compared", "13"),
        ("mean |billed - ours| per answer", "12.92 (max 1)"),
        ("mean billed - ours per answer", "+12.92"),
        ("answers off by more than 2", "12 (92.31%)"),
        ("answers without usage.prompt_tokens", "1"),
    ]:
        assert f"<th>{label}</th><td class='num'>{value}</td>" in prompt, label
    assert "class='kv over'" in prompt  # the check failed
    dist = re.findall(r"<tr><td class='num'>([^<]+)</td><td class='num'>(\d+)</td></tr>", prompt)
    assert dist == [("0", "1"), ("&gt;= +9", "12")]
    assert "<td><code>o-9</code></td><td class='num'>223</td><td class='num'>209</td><td class='num'>+14</td>" in prompt
    traj = html[html.index("Trajectories in the merge") : html.index("Overflow billing check")]
    for label, value in [
        ("kept whole", "8"),
        ("kept up to their last usable turn", "1 (unreconstructable 1)"),
        ("dropped: no usable turn", "1 (failed 1)"),
        ("turn rows", "14"),
        ("folded into a later turn&#39;s record", "4"),
        ("made a record", "9"),
    ]:
        assert f"<th>{label}</th><td class='num'>{value}</td>" in traj, label
    md = render_markdown(report, title="t")
    assert "### Overflow prompt billing" in md and "| >= +9 | 12 |" in md
    assert (
        "### Trajectories in the merge" in md
        and "| kept up to their last usable turn | 1 (unreconstructable 1) |" in md
    )
