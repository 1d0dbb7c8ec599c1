"""The run report shows the probe's verdict: its acc_k, the simulated acceptance, the held-out loss,
the last state fit and the learning curve as a line whose points follow the curve (higher acceptance drawn higher)."""

from __future__ import annotations

import re

from eagle3_data.report.data import RunReport
from eagle3_data.report.render import render_html
from eagle3_data.stages.probe.drafter import figures


def _sums(acc: list[float], total: float = 100.0, loss: float = 5.0) -> dict:
    return {
        "loss": loss,
        "first_loss": 2.5,
        "first_hits": 2.0,
        "first_total": 8.0,
        "full_acc_sum": [a * total for a in acc],
        "full_acc_total": [total] * len(acc),
        "cond_acc_sum": [a * total for a in acc],
        "cond_acc_total": [total] * len(acc),
    }


def test_the_report_draws_the_probe_curve():
    raw = {
        "name": "probe",
        "losses": [3.0, 2.0, 1.0, 0.5],
        "seconds": 1.0,
        "curve": [
            {"step": 0, **_sums([0.1, 0.0, 0.0])},
            {"step": 2, **_sums([0.6, 0.5, 0.4])},
            {"step": 4, **_sums([0.4, 0.3, 0.2], loss=4.321)},
        ],
    }
    probe = {
        **figures(raw),
        "coverage": 0.9,
        "train_samples": 16,
        "eval_samples": 4,
        "draft_vocab_size": 256,
        "steps": 4,
        "last_state_fit": {"mean_logprob": -0.8125, "top1": 0.75, "tokens": 1234},
    }
    html = render_html(RunReport("k", {"training": {"probe": probe}}, []), title="t")
    assert f"{probe['simulated_acceptance']:.2f}" in html and "probe-curve" in html
    assert probe["eval_loss"] == 4.321 and "held-out loss (speculators' KL to the target) 4.321" in html
    assert probe["first_draft"] == {"acc": 0.25, "eval_loss": 2.5, "positions": 8}
    assert "first draft (right after the prompt, 8 drafts): right 25" in html and "loss 2.500" in html
    assert "predict the trained ids (1,234 tokens" in html and "mean log-probability -0.812 nats" in html
    assert "the argmax at <b>75" in html
    points = re.search(r"class='probe-curve'>\s*<polyline[^>]*points='([^']*)'", html).group(1).split()
    xs, ys = zip(*[tuple(map(float, p.split(","))) for p in points])
    assert len(points) == len(raw["curve"]) and list(xs) == sorted(xs)
    acceptance = [c["simulated_acceptance"] for c in probe["curve"]]
    assert sorted(range(3), key=lambda i: -acceptance[i]) == sorted(range(3), key=lambda i: ys[i])  # higher: smaller y


def test_an_extracted_run_without_a_probe_says_why_not():
    """publish's reason for an extracted run without a verdict (the default auto on a worker
    without a GPU) is on the page where the verdict would be; off (never) says so."""
    from eagle3_data.stages.publish.stage import _probe_not_run

    for when, said in (("auto", "probe.when auto runs it on a worker with a GPU"), ("never", "the probe is off")):
        html = render_html(RunReport("k", {"training": {"probe_not_run": _probe_not_run(when)}}, []), title="t")
        assert "The drafter's verdict" in html and said in html and "probe-curve" not in html
    assert "The drafter's verdict" not in render_html(RunReport("k", {"training": {}}, []), title="t")


def test_the_report_opens_with_the_verdicts():
    """publish.verdicts: the extraction's self-check, the probe's export check and the probe's
    verdict, first on the page and in the Markdown."""
    from eagle3_data.report.render import render_markdown
    from eagle3_data.stages.publish.stage import verdicts

    hidden = {
        "logprob_check": {
            "compared_samples": 6,
            "compared_tokens": 120,
            "tolerance": 0.002,
            "worst_mean_abs_diff": 3e-5,
            "not_compared": {},
        }
    }
    probe = {
        "verdict": "fail",
        "verdict_rule": "alignment fail (export check failed: sample 's0' (row 0) position 11: ...)",
        "export_check": {"verdict": "fail", "error": "sample 's0' (row 0) position 11: log p ..."},
    }
    got = verdicts(hidden, probe)
    assert [(v["check"], v["verdict"]) for v in got] == [
        ("extraction", "pass"),
        ("export (the probe's)", "fail"),
        ("probe", "fail"),
    ]
    assert verdicts({"logprob_check": None}, None)[0]["verdict"] == "not compared"
    report = RunReport("k", {"training": {"verdicts": got, "probe_not_run": "Not run: (a stand-in)"}}, [])
    html = render_html(report, title="t")
    assert html.index("<section id='verdict'") < html.index("The drafter's verdict") and "position 11" in html
    assert "| all (run) | probe | 🔴 **FAIL** | alignment fail" in render_markdown(report)
