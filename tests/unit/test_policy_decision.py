"""The policy check's decision (policy_check.py) against synthetic samples of known shift.

Oracles from outside the code under test: the exact power of a minimum-effect t-test (the
noncentral t distribution, solved here for the shift it detects with 90% power) and simulation
with a known truth over many seeds; the stated rates must hold within binomial slack (3 standard
deviations of the observed rate), both ways where the statement is meant to be exact.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from eagle3_data.nucleus import Item
from eagle3_data.policy_check import (
    Thresholds,
    check,
    decide,
    policy_gate,
    power_statement,
    required_samples,
    sample_size,
    summarize,
)
from tests.simulation import slack

SEEDS = 1000


def rate(
    th: Thresholds, n: int, shift: float, sigma: float, seeds: int = SEEDS, skew: bool = False, pairs: int = 0
) -> float:
    """Share of seeds the decision rejects: `n` sample means a side, the overflow side's shifted
    down by `shift` nats/token (less likely), spread `sigma` (skewed: a gamma's long tail toward
    unlikely text, as real per-sample means have)."""
    rng = np.random.default_rng(12345)
    if skew:  # gamma with shape 2: skewness 1.4, scaled to standard deviation sigma
        draw = lambda size: -rng.gamma(2.0, sigma / math.sqrt(2.0), size)
    else:
        draw = lambda size: rng.normal(0.0, sigma, size)
    local, over = draw((seeds, n)) - 1.0, draw((seeds, n)) - 1.0 - shift
    pl = draw((seeds, pairs))
    po = pl - shift + rng.normal(0.0, sigma, (seeds, pairs))
    return float(np.mean([bool(decide(local[i], over[i], pl[i], po[i], th)["rejected"]) for i in range(seeds)]))


def exact_power(shift: float, th: Thresholds, sigma: float, n: int, alpha: float) -> float:
    """Power of the minimum-effect test at a true shift, equal n and spread a side: (D - tol) /
    SE_hat is noncentral t with 2n - 2 df (pooled variance; Welch's df equal n/spread is close)."""
    se, df = sigma * math.sqrt(2 / n), 2 * n - 2
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(
        stats.nct.sf(crit, df, (shift - th.tolerance) / se) + stats.nct.sf(crit, df, -(shift + th.tolerance) / se)
    )


def shift_at_power(th: Thresholds, sigma: float, n: int, alpha: float) -> float:
    return optimize.brentq(lambda d: exact_power(d, th, sigma, n, alpha) - th.power, th.tolerance, 10.0)


# ---- the stated false-alarm rate ----


@pytest.mark.parametrize("n,skew", [(8, False), (40, True)])
def test_false_alarm_rate_is_the_stated_one_at_the_tolerance(n, skew):
    """A true shift exactly at the tolerance (the null's edge; an honest provider is at 0, further
    inside) fails at alpha / 2 (one side of the two one-sided tests): not more, and not far less
    (the statement is exact, not merely safe). n = 8: Student's quantiles, not the normal's
    (the normal's would fail about 3x as often at alpha 0.05 / 2)."""
    th = Thresholds(shift=0.2, false_alarm_rate=0.05, power=0.9)
    seeds = 4000
    observed = rate(th, n, th.tolerance, sigma=0.3, seeds=seeds, skew=skew)
    assert abs(observed - 0.025) <= slack(0.025, seeds) + 0.006, observed  # 0.006: Welch's df and skew at small n


def test_honest_provider_fails_at_most_the_false_alarm_rate():
    """Shift 0 with a tolerance small against the standard error: the rate is the full alpha."""
    th = Thresholds(shift=0.002, false_alarm_rate=0.05, power=0.9)
    observed = rate(th, 30, 0.0, sigma=0.3, seeds=4000, skew=True)
    assert observed <= 0.05 + slack(0.05, 4000), observed
    assert observed >= 0.05 - slack(0.05, 4000) - 0.01, observed  # the test does reject at its level


def test_with_calibration_pairs_the_false_alarm_rate_is_split():
    """Two tests at alpha / 2 each (Bonferroni): together they still fail an honest provider at
    most alpha."""
    th = Thresholds(shift=0.002, false_alarm_rate=0.05, power=0.9)
    observed = rate(th, 30, 0.0, sigma=0.3, seeds=4000, pairs=10)
    assert observed <= 0.05 + slack(0.05, 4000), observed
    d = decide(np.zeros(3) + [0, 1, 2], np.zeros(3) + [0, 1, 2], [1, 2, 3], [1, 2, 4], th)
    assert d["tests"]["sampled"]["alpha"] == d["tests"]["pairs"]["alpha"] == pytest.approx(0.025)


# ---- the stated power ----


def test_stated_minimum_detectable_shift_is_the_exact_one():
    """The decision's minimum detectable shift at the true spread equals the shift at which the
    noncentral t gives 90% power (within 1%)."""
    th = Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)
    sigma, n = 0.3, 200
    rng = np.random.default_rng(0)
    base = rng.normal(0, 1, n)
    base = (base - base.mean()) / base.std(ddof=1) * sigma  # spread exactly sigma a side
    stated = decide(base, base, [], [], th)["tests"]["sampled"]["min_detectable_shift"]
    assert stated == pytest.approx(shift_at_power(th, sigma, n, 0.001), rel=0.01)


@pytest.mark.parametrize("n,skew", [(20, False), (60, True)])
def test_power_holds_at_the_stated_minimum_detectable_shift(n, skew):
    """Simulated at the shift the check says it detects with 90% power: detected 90% of seeds,
    within slack both ways."""
    th = Thresholds(shift=0.1, false_alarm_rate=0.01, power=0.9)
    sigma = 0.3
    stated = decide(*([np.linspace(-1, 1, n) / np.linspace(-1, 1, n).std(ddof=1) * sigma] * 2), [], [], th)
    mds = stated["tests"]["sampled"]["min_detectable_shift"]
    observed = rate(th, n, mds, sigma, skew=skew)
    assert abs(observed - 0.9) <= slack(0.9, SEEDS) + 0.01, (mds, observed)


def test_required_samples_reach_the_power_at_the_shift_that_matters():
    """The sampled path's size from a spread: at that size the exact power at the shift that
    matters is >= 90%, one sample fewer per 5% is below it (the size is not padded), and the
    simulation detects the shift that matters 90% of seeds."""
    th = Thresholds(shift=0.2, false_alarm_rate=0.01, power=0.9)
    sigma = 0.3
    n = required_samples(th, sigma, sigma)
    assert exact_power(th.shift, th, sigma, n, 0.01) >= 0.9
    assert exact_power(th.shift, th, sigma, int(n * 0.95), 0.01) < 0.9
    observed = rate(th, n, th.shift, sigma)
    assert observed >= 0.9 - slack(0.9, SEEDS), (n, observed)


def test_required_samples_grow_with_the_spread_and_shrink_with_the_shift():
    th = Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)
    n = required_samples(th, 0.3, 0.3)
    assert required_samples(th, 0.6, 0.6) == pytest.approx(4 * n, rel=0.02)
    assert required_samples(Thresholds(0.2, 0.001, 0.9), 0.3, 0.3) == pytest.approx(n / 4, rel=0.05)
    assert required_samples(th, 0.3, 0.3, tests=2) > n  # alpha split over the pairs' test too
    assert required_samples(th, 0.0, 0.0) == 2


def test_sample_size_from_a_pilot_uses_its_spreads_within_the_pilot_and_the_cap():
    """The pilot's spreads (not its means) set the size; never below the pilot, never above the
    cap; calibration pairs in the pilot split alpha (a larger size)."""
    th = Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)
    local, over = spread(-1.0, 32, 0.3), spread(-1.5, 32, 0.3, seed=1)
    pilot = check(local, over, th=th)["figures"]
    size = sample_size(th, pilot, 32, 4096)
    s = [float(np.std(pilot[side]["sample_means"], ddof=1)) for side in ("local", "overflow")]
    assert size["spreads"] == {"local": pytest.approx(s[0]), "overflow": pytest.approx(s[1])}
    assert size["chosen"] == size["required"] == required_samples(th, *s) > 32
    shifted = check(local, [[x + 0.5 for x in o] for o in over], th=th)["figures"]  # other means, same spreads
    assert sample_size(th, shifted, 32, 4096)["chosen"] == size["chosen"]
    assert sample_size(th, pilot, 32, 100)["chosen"] == 100
    assert sample_size(Thresholds(shift=5.0), pilot, 32, 4096)["chosen"] == 32
    with_pairs = check(local, over, [([-0.2] * 3, [-0.25 - 0.01 * i] * 3) for i in range(4)], th)["figures"]
    assert sample_size(th, with_pairs, 32, 4096)["required"] == required_samples(th, *s, tests=2)


def test_every_row_a_negligible_shift_never_fails_and_the_shift_that_matters_always_does():
    """Extraction's every row: 200 000 samples a side. A shift a fifth of the one that matters
    (numerics, a kernel) passes every seed; a test without the tolerance would fail each one
    (its standard error is ~0.001); the shift that matters fails every seed."""
    th = Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)
    rng = np.random.default_rng(1)
    n = 200_000
    for true_shift, fails in ((0.02, False), (0.1, True)):
        for _ in range(20):
            d = decide(rng.normal(-1, 0.4, n), rng.normal(-1 - true_shift, 0.4, n), [], [], th)
            assert bool(d["rejected"]) is fails, (true_shift, d["tests"]["sampled"])
            assert not d["underpowered"]
            assert d["tests"]["sampled"]["standard_error"] < 0.0015


# ---- the statistic: per-sample means, equal weight ----


def test_check_weighs_every_sample_the_same_whatever_its_length():
    """A side whose long answers are less likely and short ones more: the statistic is the mean
    of the samples' means (equal weight), not a per-token pool dominated by the long ones."""
    short, long_ = [-0.5] * 10, [-2.0] * 1000
    out = check([short, long_], [[-1.25] * 50, [-1.25] * 50], th=Thresholds())["figures"]
    assert out["local"]["mean_logprob"] == pytest.approx(-1.25)
    assert out["gap_nats_per_token"] == pytest.approx(0.0)


def items_and_scores():
    """Sampled answers on each side (local -1.0, overflow -1.2 nats/token), and 3 calibration
    prompts answered greedily on both paths (far likelier: -0.1), plus a greedy local answer whose
    overflow twin was not scored."""
    items, scores = [], []
    for side, mean in (("local", -1.0), ("overflow", -1.2)):
        for i in range(6):
            items.append(Item(f"{side}-{i}", side, side, (1, 2, 3, 4 + i), 1))
            scores.append([mean + 0.05 * (i - 2.5)] * (3 + 10 * i))
    for i in range(3):
        for side in ("local", "overflow"):
            items.append(Item(f"cal-{i}", side, "both", (1, 2, 9) if i or side == "local" else (1, 2, 8), 1))
            scores.append([-0.1 - 0.01 * i] * 2)
    items.append(Item("cal-lone", "local", "both", (1, 5), 1))
    scores.append([-0.05] * 2)
    return items, scores


def test_summarize_keeps_greedy_calibration_answers_out_of_the_sampled_pools():
    items, scores = items_and_scores()
    s = summarize(items, scores, {})
    assert (s["local"]["samples"], s["overflow"]["samples"]) == (6, 6)
    assert s["gap_nats_per_token"] == pytest.approx(0.2)  # sampled only, each sample weighed once
    assert s["pairs"]["samples"] == 3 and s["pairs"]["sample_ids"] == ["cal-0", "cal-1", "cal-2"]
    assert s["pairs"]["identical_ids"] == 2  # cal-0's overflow answer differs
    assert s["pairs"]["mean_difference"] == pytest.approx(0.0)


# ---- the gate's branches ----

TH = Thresholds(shift=0.1, false_alarm_rate=0.001, power=0.9)


def figures(local, overflow, pairs=()):
    return check(local, overflow, pairs, TH)["figures"]


def spread(mean: float, n: int, sd: float, seed: int = 0) -> list[list[float]]:
    return [[x] * 5 for x in np.random.default_rng(seed).normal(mean, sd, n)]


def test_gate_without_figures_or_skipped_or_without_overflow_notes_and_passes():
    assert policy_gate(None, TH) == {
        "passed": True,
        "reasons": [],
        "notes": ["policy not scored (no score_policy stage for this run)"],
    }
    assert policy_gate({"skipped": "no overflow answers"}, TH)["notes"] == ["policy not checked: no overflow answers"]
    empty = figures(spread(-1, 10, 0.1), [])
    assert policy_gate(empty, TH) == {"passed": True, "reasons": [], "notes": ["policy: no overflow answers to check"]}


def test_gate_with_one_overflow_sample_cannot_test_and_says_it_is_underpowered():
    g = policy_gate(figures(spread(-1, 10, 0.1), [[-5.0] * 4]), TH)
    assert g["passed"] and g["decision"]["tests"] == {}
    assert "sampled answers: not tested (fewer than 2 a side)" in g["notes"][0]
    assert g["notes"][-1].startswith("policy UNDERPOWERED")


def test_gate_fails_an_overflow_less_likely_beyond_the_tolerance():
    g = policy_gate(figures(spread(-1.0, 300, 0.3), spread(-1.3, 300, 0.3, seed=1)), TH)
    assert not g["passed"] and g["decision"]["rejected"] == ["sampled"]
    assert g["reasons"][0].startswith("overflow text is off the target's policy, less likely under the target")
    assert "sampled answers" in g["reasons"][0] and "over 300 + 300 samples" in g["reasons"][0]


def test_gate_fails_an_overflow_more_likely_beyond_the_tolerance():
    g = policy_gate(figures(spread(-1.3, 300, 0.3), spread(-1.0, 300, 0.3, seed=1)), TH)
    assert not g["passed"] and "more likely under the target than its own text: a greedier sampler" in g["reasons"][0]


def test_gate_passes_a_shift_within_the_tolerance_with_power_and_says_so():
    g = policy_gate(figures(spread(-1.0, 3000, 0.3), spread(-1.02, 3000, 0.3, seed=1)), TH)
    assert g["passed"] and not g["reasons"] and not g["decision"]["underpowered"]
    assert g["notes"][0].startswith("policy: mean log-probability local")
    assert g["notes"][1].startswith("policy power: sampled answers (3000 + 3000): detects a shift of 0.0")
    assert not any("UNDERPOWERED" in n for n in g["notes"])


def test_gate_passes_underpowered_samples_that_show_nothing_with_a_warning():
    """Underpowered is a note, not a failure (policy_gate's docstring says why)."""
    g = policy_gate(figures(spread(-1.0, 20, 0.3), spread(-1.0, 20, 0.3, seed=1)), TH)
    assert g["passed"] and g["decision"]["underpowered"]
    assert "UNDERPOWERED (larger than the shift that matters, 0.1)" in g["notes"][1]
    assert g["notes"][2].startswith("policy UNDERPOWERED: it cannot see a shift of 0.1 nats/token with 90% power")


def test_gate_fails_on_calibration_pairs_alone():
    """Sampled answers alike (a sampler's fault would show there), greedy answers to the same
    prompts apart (other weights show there): the pairs' test fails it."""
    local = spread(-1.0, 40, 0.3)
    pairs = [([x] * 4, [x - 0.5 + e] * 4) for x, e in zip(np.linspace(-0.3, -0.1, 12), np.linspace(-0.05, 0.05, 12))]
    g = policy_gate(figures(local, local, pairs), TH)
    assert not g["passed"] and g["decision"]["rejected"] == ["pairs"]
    assert "calibration pairs (same prompt, greedy on both paths)" in g["reasons"][0]
    assert "over 12 prompts" in g["reasons"][0]


def test_gate_on_identical_calibration_pairs_passes_and_on_a_constant_gap_fails():
    """Greedy answers identical on both paths: no spread, an exact difference of 0; a constant
    difference beyond the tolerance, exact too: fails without a spread to test against."""
    local = spread(-1.0, 40, 0.3)
    same = [([-0.2] * 3, [-0.2] * 3)] * 5
    g = policy_gate(figures(local, local, same), TH)
    assert g["passed"] and g["decision"]["tests"]["pairs"]["standard_error"] == 0
    apart = [([-0.2] * 3, [-0.4] * 3)] * 5
    g = policy_gate(figures(local, local, apart), TH)
    assert not g["passed"] and g["decision"]["rejected"] == ["pairs"]


def test_check_returns_the_gates_verdict_from_per_token_logprobs():
    """The entry point for any source of per-token log-probabilities (the extraction's, later):
    the same verdict the gate gives on the same figures."""
    local, over = spread(-1.0, 300, 0.3), spread(-1.3, 300, 0.3, seed=1)
    out = check(local, over, th=TH)
    assert out == {**policy_gate(out["figures"], TH), "figures": out["figures"]}
    assert not out["passed"] and out["decision"]["rejected"] == ["sampled"]


def test_power_statement_names_each_test_and_its_samples():
    d = decide([0, 1, 2], [0, 1, 2], [1, 2], [1, 3], TH)
    text = power_statement(d)
    assert text.startswith("sampled answers (3 + 3): detects a shift of ")
    assert "calibration pairs (2): detects a shift of " in text and "at false-alarm rate 0.0005" in text


def test_every_row_gate_compares_local_engines_with_the_provider_by_source():
    """The extraction's per-sample means by merged source: sglang and vllm are the local side,
    openrouter the overflow side; a shift of 1 nat/token over hundreds of samples fails, the
    same distribution passes, and a source the check does not know is left out."""
    from eagle3_data.policy_check import Thresholds, every_row_gate

    rng = np.random.default_rng(5)
    local = {"sglang": list(rng.normal(-2.0, 0.3, 300)), "vllm": list(rng.normal(-2.0, 0.3, 100))}
    honest = every_row_gate(
        {**local, "openrouter": list(rng.normal(-2.0, 0.3, 400)), "other": [-50.0] * 9}, Thresholds()
    )
    assert honest["passed"] and honest["decision"]["tests"]["sampled"]["samples"] == [400, 400]
    shifted = every_row_gate({**local, "openrouter": list(rng.normal(-3.0, 0.3, 400))}, Thresholds())
    assert not shifted["passed"] and "less likely under the target" in shifted["reasons"][0]
    assert every_row_gate(local, Thresholds())["notes"] == ["policy: no overflow answers to check"]
