"""The run report opens with its verdict: one line per dataset per check (gate, policy; the
extraction's self-check, the export check where one was made, the probe), green, red or grey (not
run, saying why), the stand-ins named, a failed line's next step naming flags that exist. Below it,
histogram bins read as distinct ranges, and the policy check is stated once, in sentences."""

from __future__ import annotations

import re

import pytest

from eagle3_data.report.data import DatasetReport, RunReport
from eagle3_data.report.render import edge_labels, every_row_histograms, render_html, render_markdown

URI = "s3://bucket/runs/date=2026-12-07/validate/{}/report.json"


def _policy(shift: float) -> dict:
    """The policy gate as pipeline.validate writes it (policy.compare, its producer): 12 local and
    12 overflow answers, the overflow ones `shift` nats/token less likely; nucleus counts 0 of 91
    outside on both paths."""
    from eagle3_data.nucleus import Item
    from eagle3_data.policy_check import Thresholds, policy_gate, summarize

    items = [Item(f"{side}-{i}", side, side, (1, 2, 3, 4), 1) for side in ("local", "overflow") for i in range(12)]
    scores = [[-0.2 - 0.01 * (i % 12) - (shift if it.side == "overflow" else 0.0)] * 3 for i, it in enumerate(items)]
    figures = {
        **summarize(items, scores, {}),
        "nucleus": {"local": {"tokens": 91, "outside": 0}, "overflow": {"tokens": 91, "outside": 0}},
    }
    return {**policy_gate(figures, Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)), "figures": figures}


def _dataset(name: str, passed: bool) -> DatasetReport:
    reasons = [] if passed else ["local round trip: text_diff rate 25.00% > 0.00% (2 of 8 samples)"]
    validation = {
        "samples": 8,
        "counts": {"exact": 6 if not passed else 8, "text_diff": 0 if passed else 2},
        "run_gate": {"passed": passed, "reasons": reasons},
        "policy": _policy(0.0 if passed else 1.0),
    }
    generation = {"local": {"ok": 8, "failed": 2, "prompt_tokens": 1, "completion_tokens": 1, "cost_usd": 0.0}}
    return DatasetReport(name, validation=validation, generation=generation, validation_uri=URI.format(name))


def _report() -> RunReport:
    verdicts = [
        {"check": "extraction", "verdict": "pass", "rule": "6 answers within 0.002 nats"},
        {"check": "export (the probe's)", "verdict": "fail", "rule": "sample 's0' position 11: log p differs"},
    ]
    index = {
        "stand_ins": ["tokenizer", "local_engine"],  # config.StandIn's roles
        "training": {"verdicts": verdicts, "probe_not_run": "Not run: the probe is off (probe.when never)."},
    }
    return RunReport("date=2026-12-07", index, [_dataset("chat", True), _dataset("tool_calls", False)])


EXPECTED = {
    ("chat", "gate (bulk mismatch validation)"): "pass",
    ("chat", "policy check"): "pass",
    ("tool_calls", "gate (bulk mismatch validation)"): "fail",
    ("tool_calls", "policy check"): "fail",
    ("all (run)", "extraction self-check"): "pass",
    ("all (run)", "export check"): "fail",
    ("all (run)", "probe"): "neutral",
}


def test_the_page_opens_with_one_line_per_dataset_per_check():
    html = render_html(_report(), title="t")
    body = html.split("</h1>", 1)[1].lstrip()
    assert body.startswith("<section id='verdict' class='verdict'>"), body[:200]  # first, before any detail
    block = body.split("</section>", 1)[0]
    lines = re.findall(r"<tr class='v-(\w+)' data-state='\1' data-dataset='([^']*)' data-check='([^']*)'>", block)
    assert [(d, c) for _, d, c in lines] == list(EXPECTED)  # one line each, none twice
    assert {(d, c): s for s, d, c in lines} == EXPECTED
    rows = dict(zip([(d, c) for _, d, c in lines], block.split("<tr class='v-")[1:]))
    for key, state in EXPECTED.items():
        assert f"<span class='state {state}'>" in rows[key], key
        assert ("Next:" in rows[key]) == (state == "fail"), key
    css = html.split("<style>", 1)[1]
    assert ".state.pass{background:#2e7d32}" in css and ".state.fail{background:#c62828}" in css  # green, red
    assert "Stand-ins in this run: <b>dev tokenizer, dev inference server as the local engine</b>" in block
    assert "the probe is off" in rows[("all (run)", "probe")]  # not run, and why
    # the count says what it counts: 8 local answers of the 8 answered, 2 failed in generation
    assert "8 local answers round-tripped" in rows[("chat", "gate (bulk mismatch validation)")]
    assert "2 failed in generation, not validated" in rows[("chat", "gate (bulk mismatch validation)")]
    gate_next = rows[("tool_calls", "gate (bulk mismatch validation)")]
    assert "fresh_stages [&#34;validate&#34;, &#34;merge&#34;, &#34;hidden_states&#34;, &#34;probe&#34;]" in gate_next
    assert (
        "eagle3-data validate --input s3://bucket/runs/date=2026-12-07/reconstruct/tool_calls "
        "--fresh validate --fresh merge --fresh hidden_states --fresh probe" in gate_next
    )


def test_a_run_without_hidden_states_says_its_extraction_and_probe_did_not_run():
    html = render_html(RunReport("k", {}, [_dataset("chat", True)]), title="t")
    for check in ("extraction self-check", "probe"):
        line = html.split(f"data-check='{check}'>")[1].split("</tr>")[0]
        assert "<span class='state neutral'>not run</span>" in line and "no hidden states were committed" in line
    assert "data-check='export check'" not in html  # only where the probe made one


def test_next_steps_name_only_flags_and_stages_that_exist():
    from eagle3_data.cli import build_parser
    from eagle3_data.report.render import verdict_lines
    from eagle3_data.stages import FRESH_STAGES

    parser = build_parser()
    for ln in verdict_lines(_report())["lines"]:
        if not ln["next"]:
            continue
        for stage in re.findall(r"--fresh (\w+)", ln["next"]) + re.findall(r'"(\w+)"', ln["next"]):
            assert stage in FRESH_STAGES, (stage, ln)
        for cmd in re.findall(r"`([^`]*)`", ln["next"]):
            argv = cmd.split()[1:]
            args = parser.parse_args(argv)  # exits (SystemExit) on a flag the CLI does not have
            assert args.fresh, cmd


def test_the_markdown_opens_with_the_same_verdict():
    md = render_markdown(_report())
    assert md.split("\n## ", 2)[1].startswith("Verdict\n"), md[:300]
    block = md.split("\n## ", 2)[1]
    assert "Stand-ins in this run: **dev tokenizer, dev inference server as the local engine**" in block
    rows = [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| dataset")]
    assert len(rows) == len(EXPECTED)
    mark = {"pass": "🟢", "fail": "🔴", "neutral": "⚪"}
    for row, ((dataset, check), state) in zip(rows, EXPECTED.items()):
        assert row.startswith(f"| {dataset} | {check} | {mark[state]} "), row
        assert ("**Next:**" in row) == (state == "fail"), row


@pytest.mark.parametrize(
    "edges",
    [
        [float("-inf"), -20.0, -19.75, -15.0, float("inf")],
        [-1.5, -1.35, -1.2, -1.05],
        [0, 5, 10, 15],
        [-0.04, 0.0, 0.04],
    ],
)
def test_bin_labels_are_distinct_correctly_rounded_edges(edges):
    labels = edge_labels(edges)
    assert len(set(labels)) == len(labels), labels
    for e, label in zip(edges, labels):
        if label in ("-inf", "inf"):
            continue
        digits = len(label.split(".")[1]) if "." in label else 0
        assert float(label.replace(",", "")) == round(e, digits), (e, label)  # rounded, not cut
    assert "-0" not in labels


def test_every_histogram_bar_is_labelled_by_its_range():
    """The extraction's histograms had axes reading "-inf, -20, -20": each bar now reads its range."""
    import torch

    from eagle3_data.target_head.logprobs import LogprobStats

    stats = LogprobStats()
    for i, m in enumerate([-25.0, -19.9, -0.4, -2.5]):
        stats.add(f"s-{i}", torch.tensor([float("nan"), m, m]), [0, 1, 1], "vllm")
    from eagle3_data.stages.hidden_states.extract import _logprob_totals  # the shards' figures added up, as committed

    logprobs = _logprob_totals([{"logprobs": stats.summary()}])["logprobs"]
    (fig,) = every_row_histograms(logprobs)
    html = render_html(RunReport("k", {"training": {"logprobs": logprobs}}, []), title="t")
    labels = [b["label"] for b in fig["chart"]["bars"]]
    assert labels[0].startswith("[-inf, -20") and len(set(labels)) == len(labels), labels
    for b in fig["chart"]["bars"]:
        assert re.fullmatch(r"\[(-inf|-?[\d,]+(\.\d+)?), (inf|-?[\d,]+(\.\d+)?)\)", b["label"]), b["label"]
        assert f">{b['label']}</text>" in html  # drawn under its bar, not only in the tooltip
    assert len(html.split(">-20</text>")) == 1  # no bare edge labels left on the axis


def test_the_policy_statement_appears_once_in_sentences():
    report = _report()
    html = render_html(report, title="t")
    md = render_markdown(report)
    for text in (html, md):
        assert "policy power:" not in text  # the gate's raw note is not shown beside its sentences
        for ds in ("chat", "tool_calls"):
            part = text[text.index(f"<section id='ds-{ds}'>" if text is html else f"\n## {ds}\n") :]
            part = part.split("</section>")[0] if text is html else part.split("\n## ", 2)[1]
            assert part.count("The policy check in sentences:") == 1, ds
            assert part.count("Nucleus test: 0 of the 91 local and 0 of the 91 overflow answer tokens lie outside") == 1
            assert part.count("detects a shift of") == 1  # the sampled test's power, said once (no pairs here)
