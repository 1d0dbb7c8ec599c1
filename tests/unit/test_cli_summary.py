"""Stage commands print a summary of at most 20 lines on a terminal (what was committed, where,
counts, spend, the gate) and the full record as JSON with `--json` or when piped (issue 57 item 3)."""

from __future__ import annotations

import json

import pytest

from eagle3_data.cli import runs
from eagle3_data.runs.results import Gate, GenerationResult, PublishResult, ValidateResult

URI = "s3://eagle3/eagle3-datagen/runs/k1/generate_local/chat"


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr(runs, "JSON_OUTPUT", False)


def test_a_generation_stage_in_a_few_lines(terminal):
    out = runs.printed(
        GenerationResult(uri=URI, counts={"ok": 40, "failed": 1}, rows=41, tokens=12345, cost_usd=0.12345)
    )
    lines = out.splitlines()
    assert lines[0] == f"committed: {URI}" and lines[-1] == "(--json: the full record)"
    assert "counts: ok 40, failed 1" in lines and "tokens: 12,345" in lines and "cost_usd: $0.1235" in lines
    assert runs.printed(GenerationResult(uri=URI, reused=True)).startswith(f"reused (already committed): {URI}")


def test_a_failed_gate_says_so_with_its_reasons(terminal):
    gate = Gate(passed=False, reasons=["text_diff rate 2.50% > max 0.00%"])
    out = runs.printed(ValidateResult(uri=URI, report_uri=URI + "/report.json", counts={"exact": 37}, gate=gate))
    assert "gate: FAILED: text_diff rate 2.50% > max 0.00%" in out.splitlines()


def test_publish_of_hundreds_of_lines_stays_under_twenty_and_json_keeps_everything(terminal, monkeypatch):
    summary = {"datasets": {f"d{i}": {"gate": {"passed": True}, "rows": i} for i in range(300)}}
    result = PublishResult(
        run_key="k1",
        report_uri="s3://eagle3/eagle3-datagen/runs/k1/report/run/run_report.json",
        summary_uri="s3://eagle3/eagle3-datagen/runs/k1/publish/all/summary.json",
        datasets=[f"d{i}" for i in range(300)],
        cost_usd=1.5,
        summary=summary,
        stand_ins=["tokenizer", "model"],
    )
    full = json.dumps(result.as_dict(), indent=1).splitlines()
    out = runs.printed(result).splitlines()
    assert len(full) > 900 and len(out) <= 20
    assert out[0] == "committed: s3://eagle3/eagle3-datagen/runs/k1/publish/all/summary.json"
    assert "datasets: 300 entries" in out and "cost_usd: $1.5000" in out and "stand_ins: tokenizer, model" in out
    monkeypatch.setattr(runs, "JSON_OUTPUT", True)
    assert json.loads(runs.printed(result))["summary"] == summary


def test_json_anywhere_on_the_line_and_json_when_piped(monkeypatch):
    from eagle3_data.cli import main
    from eagle3_data.config import DEFAULT_CONFIG_PATH

    assert main(["config", "check", str(DEFAULT_CONFIG_PATH), "--json"]) == 0 and runs.JSON_OUTPUT
    assert main(["config", "check", str(DEFAULT_CONFIG_PATH)]) == 0 and not runs.JSON_OUTPUT
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)  # piped: scripts keep their JSON
    assert json.loads(runs.printed(GenerationResult(uri=URI)))["uri"] == URI
