"""The policy check's nucleus test (policy_check.py `nucleus_test`) against synthetic token counts
of known outside-rate.

Oracles from outside the code under test: simulation with a known truth over many seeds (the
stated false-alarm rate and the stated power must hold within binomial slack, 3 standard
deviations of the observed rate), and scipy's binomial distribution for the rejection region.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats

from eagle3_data.policy_check import (
    NUCLEUS_RATE,
    Thresholds,
    decide,
    every_row_gate,
    nucleus_counts,
    nucleus_test,
    policy_gate,
    power_statement,
)
from tests.simulation import slack

SEEDS = 2000


def counts(a: int, n: int, b: int, m: int) -> dict:
    return {"local": {"tokens": n, "outside": a}, "overflow": {"tokens": m, "outside": b}}


@functools.lru_cache(maxsize=None)
def rejects(a: int, n: int, b: int, m: int, alpha: float) -> bool:
    """The decision on one draw of counts (draws repeat: each distinct one is decided once)."""
    return nucleus_test(counts(a, n, b, m), alpha, 0.9)["rejected"]


def rejection_rate(alpha: float, n: int, m: int, local_rate: float, over_rate: float, seeds: int = SEEDS) -> float:
    rng = np.random.default_rng(2929)
    a, b = rng.binomial(n, local_rate, seeds), rng.binomial(m, over_rate, seeds)
    return float(np.mean([rejects(int(a[i]), n, int(b[i]), m, alpha) for i in range(seeds)]))


@pytest.mark.parametrize("rate", [0.0, 0.003, 0.02])
def test_false_alarm_rate_holds_when_both_paths_leave_the_nucleus_alike(rate):
    """Honest: the same outside-rate on both paths (0: exact ids; > 0: re-split tokens on both
    sides alike). Fisher's test conditions on the margins: at most alpha."""
    alpha = 0.05
    got = rejection_rate(alpha, 1000, 800, rate, rate)
    assert got <= alpha + slack(alpha, SEEDS), got


def test_power_holds_at_the_stated_minimum_detectable_rate():
    """The local counts as observed (0 of 3000), 1500 overflow tokens: overflow counts drawn at the
    stated rate are rejected with the stated power (90%); at half of it, clearly less often."""
    alpha, n, m = 0.001 / 3, 3000, 1500
    t = nucleus_test(counts(0, n, 0, m), alpha, 0.9)
    mdr = t["min_detectable_rate"]
    assert 0 < mdr < NUCLEUS_RATE and not t["underpowered"], t
    # the rejection region as scipy's binomial says it: P(B >= b*) at the stated rate is the power
    assert stats.binom.sf(t["critical_outside"] - 1, m, mdr) == pytest.approx(0.9, abs=1e-6)
    rng = np.random.default_rng(7)
    b = rng.binomial(m, mdr, SEEDS)
    got = float(np.mean([rejects(0, n, int(x), m, alpha) for x in b]))
    assert abs(got - 0.9) <= slack(0.9, SEEDS), got
    b = rng.binomial(m, mdr / 2, SEEDS)
    assert float(np.mean([rejects(0, n, int(x), m, alpha) for x in b])) < 0.5


def test_a_provider_ignoring_top_p_is_caught_at_the_trials_size():
    """~5% outside (1 - top_p 0.95) on 500 overflow tokens against an honest local path: rejected
    on (nearly) every seed at the default false-alarm rate split over three tests."""
    got = rejection_rate(0.001 / 3, 500, 500, 0.0, 0.05, seeds=500)
    assert got >= 0.99, got


def test_too_few_tokens_cannot_reject_and_say_so():
    t = nucleus_test(counts(0, 3, 2, 3), 0.001, 0.9)
    assert not t["rejected"] and t["min_detectable_rate"] is None and t["underpowered"], t
    t = nucleus_test(counts(0, 100, 0, 100), 0.001, 0.9)  # a rate it can see, but above the one that matters
    assert t["min_detectable_rate"] > NUCLEUS_RATE and t["underpowered"], t


def test_decide_runs_the_nucleus_test_only_with_tokens_on_both_sides_and_splits_the_rate():
    rng = np.random.default_rng(1)
    local, over = rng.normal(-1, 0.3, 40), rng.normal(-1, 0.3, 40)
    th = Thresholds()
    plain = decide(local, over, [], [], th)
    assert "nucleus" not in plain["tests"] and plain["tests"]["sampled"]["alpha"] == th.false_alarm_rate
    assert (
        "nucleus: not tested (the sampling has no nucleus to check: greedy, no top_p or top_k, or a "
        "penalty; or no checked answer token on a side; docs/generation.md)" in power_statement(plain)
    )
    for missing in (None, counts(0, 0, 10, 500), counts(0, 500, 0, 0)):
        assert "nucleus" not in decide(local, over, [], [], th, missing)["tests"]
    both = decide(local, over, [1.0, 2.0], [1.0, 2.5], th, counts(0, 800, 40, 800))
    assert set(both["tests"]) == {"sampled", "pairs", "nucleus"}
    assert {t["alpha"] for t in both["tests"].values()} == {th.false_alarm_rate / 3}
    assert both["rejected"] == ["nucleus"], both["rejected"]


def same_means(seed: int) -> dict:
    """A policy summary whose sampled sides have the same per-sample means (so only the count
    tests can fail it) and no calibration pairs."""
    means = list(np.random.default_rng(seed).normal(-1, 0.3, 60))
    return {
        "local": {"samples": 60, "sample_means": means, "mean_logprob": -1.0},
        "overflow": {"samples": 60, "sample_means": means[::-1], "mean_logprob": -1.0},
        "pairs": {"samples": 0},
    }


def test_gate_fails_a_provider_outside_the_nucleus_and_passes_an_honest_one():
    base = same_means(3)
    th = Thresholds()
    bad = policy_gate({**base, "nucleus": counts(0, 1200, 60, 1200)}, th)
    assert not bad["passed"], bad
    assert [r for r in bad["reasons"] if "outside the nucleus" in r and "60 of 1200 overflow" in r], bad["reasons"]
    honest = policy_gate({**base, "nucleus": counts(30, 1200, 31, 1200)}, th)
    assert honest["passed"], honest["reasons"]
    assert any(n.startswith("policy: nucleus: 31 of 1200") for n in honest["notes"]), honest["notes"]
    statement = power_statement(honest["decision"])
    assert statement.startswith("nucleus (1200 + 1200 answer tokens): detects an outside-rate of "), statement


def test_every_row_reports_the_extractions_nucleus_counts_per_path_without_testing_them():
    sources = {
        "vllm": {"nucleus": {"samples": 3, "tokens": 300, "outside": 0}},
        "sglang": {"nucleus": {"samples": 1, "tokens": 100, "outside": 1}},
        "openrouter": {"nucleus": {"samples": 4, "tokens": 400, "outside": 20}},
        "unknown": {},
    }
    got = nucleus_counts(sources)
    assert got == {
        "local": {"samples": 4, "tokens": 400, "outside": 1},
        "overflow": {"samples": 4, "tokens": 400, "outside": 20},
    }
    assert nucleus_counts({"vllm": {}}) is None
    rng = np.random.default_rng(5)
    means = {"vllm": list(rng.normal(-1, 0.3, 50)), "openrouter": list(rng.normal(-1, 0.3, 50))}
    gate = every_row_gate(means, Thresholds(), got)
    assert gate["passed"] and "nucleus" not in gate["decision"]["tests"], gate
    assert any("1 of 400 local and 20 of 400 overflow" in n for n in gate["notes"]), gate["notes"]


def test_decide_runs_the_greedy_test_on_calibration_counts_beside_the_others():
    """The calibration answers' off-argmax counts (`greedy`) are a fourth test, at its own share of
    the false-alarm rate; a provider whose greedy answers leave the target's argmax (other weights)
    fails on it alone, and one at the local path's rate passes."""
    rng = np.random.default_rng(11)
    local, over = rng.normal(-1, 0.3, 40), rng.normal(-1, 0.3, 40)
    th = Thresholds()
    plain = decide(local, over, [1.0, 2.0], [1.0, 2.0], th, counts(0, 800, 0, 800))
    assert "greedy" not in plain["tests"]
    assert power_statement(plain).endswith(
        "greedy: not tested (no calibration answer scored on both sides: routing.calibration_samples)"
    )
    for missing in (counts(0, 0, 10, 500), counts(0, 500, 0, 0)):
        assert "greedy" not in decide(local, over, [], [], th, None, missing)["tests"]
    quantised = decide(local, over, [1.0, 2.0], [1.0, 2.0], th, counts(0, 800, 0, 800), counts(1, 600, 18, 600))
    assert set(quantised["tests"]) == {"sampled", "pairs", "nucleus", "greedy"}
    assert {t["alpha"] for t in quantised["tests"].values()} == {th.false_alarm_rate / 4}
    assert quantised["rejected"] == ["greedy"], quantised["rejected"]
    honest = decide(local, over, [1.0, 2.0], [1.0, 2.0], th, None, counts(3, 600, 4, 600))
    assert honest["rejected"] == [] and {t["alpha"] for t in honest["tests"].values()} == {th.false_alarm_rate / 3}
    assert "greedy (600 + 600 calibration answer tokens): detects an off-argmax rate of " in power_statement(honest)


def test_gate_names_a_provider_that_leaves_the_targets_argmax():
    base = same_means(13)
    bad = policy_gate({**base, "greedy": counts(0, 512, 15, 512)}, Thresholds())
    assert not bad["passed"], bad
    assert [
        r for r in bad["reasons"] if "leave the target's argmax" in r and "15 of 512 overflow answer tokens not" in r
    ], bad["reasons"]
    honest = policy_gate({**base, "greedy": counts(0, 512, 0, 512)}, Thresholds())
    assert honest["passed"], honest["reasons"]
    assert any(n.startswith("policy: greedy: 0 of 512 overflow") for n in honest["notes"]), honest["notes"]


def test_greedy_counts_only_the_calibration_answers_and_nucleus_counts_only_the_sampled():
    from eagle3_data.nucleus import Item
    from eagle3_data.nucleus import nucleus_counts as item_counts

    items = [
        Item("a", "local", "local", (1, 2, 3, 4), 1),
        Item("b", "overflow", "overflow", (1, 2, 3), 1),
        Item("c", "local", "both", (1, 2, 3, 4, 5), 2),
        Item("c", "overflow", "both", (1, 2, 3, 4), 2),
        Item("d", "overflow", "both", (1, 2), 1),
    ]
    outside = [1, 0, 2, 1, None]
    assert item_counts(items, outside) == {
        "local": {"samples": 1, "tokens": 3, "outside": 1},
        "overflow": {"samples": 1, "tokens": 2, "outside": 0},
    }
    assert item_counts(items, outside, greedy=True) == {
        "local": {"samples": 1, "tokens": 3, "outside": 2},
        "overflow": {"samples": 1, "tokens": 2, "outside": 1},
    }


def test_the_report_shows_each_count_test_with_its_counts_and_flags_a_rejection():
    """The gate's verdict, through the report's policy summary, as the provider table's rows:
    the nucleus and greedy tests each with both paths' counts and the p-value, the rejected one
    flagged."""
    from eagle3_data.report.data import policy_summary
    from eagle3_data.report.render import _provider

    rng = np.random.default_rng(17)
    means = list(rng.normal(-1, 0.3, 60))
    figures = {
        "local": {"samples": 60, "sample_means": means, "mean_logprob": -1.0},
        "overflow": {"samples": 60, "sample_means": means[::-1], "mean_logprob": -1.0},
        "pairs": {"samples": 0},
        "nucleus": counts(2, 900, 3, 900),
        "greedy": counts(0, 512, 15, 512),
    }
    gate = policy_gate(figures, Thresholds())
    rows = _provider(None, policy_summary({**gate, "figures": figures}))["rows"]
    got = {label: (value, flagged) for label, value, flagged in rows}
    nucleus = got["nucleus: tokens outside, local / overflow / p-value (level)"]
    greedy = got["greedy: tokens off the target's argmax, local / overflow / p-value (level)"]
    assert nucleus[0].startswith("2 of 900 / 3 of 900 / ") and not nucleus[1], nucleus
    assert greedy[0].startswith("0 of 512 / 15 of 512 / ") and greedy[1], greedy


def test_off_argmax_counts_a_token_only_clearly_below_the_argmax_and_within_the_window():
    from eagle3_data.nucleus import off_argmax

    own = [-1.0, -1.0005, -1.5, -3.5, -2.0, -0.7]
    top = [[-1.0, -2.0], [-1.0, -3.0], [-1.0, -1.5], [-1.0, -3.5], [-1.2, float("nan")], [-0.7, float("nan")]]
    # gaps: 0 (the argmax), 5e-4 (a near-tie inside the margin), 0.5, 2.5 (beyond the window), 0.8 (a
    # padded row), 0 (the argmax, padded)
    got = off_argmax(own, top, logit_margin=1e-3, max_gap=1.0)
    assert got.tolist() == [False, False, True, False, True, False]
    assert off_argmax(own, top, logit_margin=1e-3, max_gap=3.0).tolist() == [False, False, True, True, True, False]
    assert off_argmax([], np.zeros((0, 1)), 1e-3, 1.0).size == 0
