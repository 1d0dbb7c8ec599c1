"""The policy check's statistics: the figures, the decision, and its power.

The unit of observation is a sample's mean log-probability per answer token under the target:
a sample's tokens are not independent draws (one early choice sets the rest), its mean is one
observation, and every sample weighs the same (a per-token pooled mean lets a few long answers
decide, and its spread is not the one a test over samples uses). Two tests, each on that unit:

- **sampled**: the local answers against the overflow answers at the configured sampling (the
  greedy calibration answers never enter these pools: they are far likelier under the target
  than sampled text and their share differs per side). Statistic D = mean of the local samples'
  means minus mean of the overflow samples' means (positive: the overflow text is less likely
  under the target than its own text), Welch's standard error and degrees of freedom.
- **pairs**: the calibration prompts, answered greedily on both paths: the same prompt, so the
  per-pair difference d_i = local mean - overflow mean removes the prompt's own difficulty.
  Statistic mean(d), paired standard error. Honest paths are exchangeable (the same model and
  sampler behind each), so d is symmetric about 0; greedy text cannot show a sampling parameter
  the provider ignores, only other weights.

- **nucleus** (when the run's sampling has one: top_p < 1 or a top_k; counted by score_policy from
  the local engine's top-K log-probabilities at every answer position, `nucleus`): the
  answer tokens of sampled answers that lie provably outside the nucleus their sampling allowed
  (top_p, top_k after temperature), overflow against local. An honest sampler never emits one
  (re-split tokens aside, alike on both sides; rounding at the boundary the rule's margins
  absorb); a provider ignoring top_p p emits one about (1 - p) of the time (the tail's mass). A
  one-sided Fisher exact test on the 2 x 2 token counts (outside / inside per path) at the split
  false-alarm rate; its power: the smallest overflow outside-rate it detects with `power` given the
  local counts and the overflow tokens at hand (`nucleus_test`). It cannot see a fault that stays
  inside the nucleus (a temperature shift within it, other weights): the mean-gap tests' job.
- **greedy** (when calibration answers were scored on both sides, `nucleus.off_argmax`):
  the calibration answers' tokens that are provably not the target's argmax yet near it (the
  argmax above them by more than the logit margin, at most `policy.greedy_max_gap`), overflow
  against local, by the nucleus test's Fisher test and power. Greedy decoding of the target's own
  weights picks the argmax at every step, near-ties within the margin aside (kernels, batch
  shapes, bf16), so an honest provider's rate is the local path's (re-split tokens, alike on both
  sides); weights other than the target's (a quantisation) leave the argmax wherever their logits
  reorder a near-tie by more than the margin: the fault the mean tests cannot see, since such
  text is about as likely under the target as its own (benchmarks/policy_power.py, the int8-rounded
  provider).

The two mean tests are minimum-effect tests: the shift that matters is `shift` (nats/token); a shift up to
`shift / 2` (the tolerance) is accepted as the same policy, so that with every row scored a
real but negligible difference (numerics, a kernel) never fails a dataset however small its
standard error. A test rejects when (|D| - tolerance) / SE > t(1 - a/2, df), a = the
false-alarm rate split over the tests run (Bonferroni): a provider whose true shift is within
the tolerance (an honest one: 0) fails with probability at most the false-alarm rate. Its
minimum detectable shift, the smallest true shift it fails with probability `power`, is
tolerance + (t(1 - a/2, df) + t(power, df)) * SE; when that exceeds `shift` the check is
underpowered for the samples at hand and says so (docs/generation.md, "The policy check").

`check` takes per-token log-probabilities from any source (the scoring requests here; the
extraction's, for every row, later); `decide` takes the per-sample means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from eagle3_data.gate_defaults import (
    DEFAULT_POLICY_FALSE_ALARM_RATE,
    DEFAULT_POLICY_POWER,
    DEFAULT_POLICY_SHIFT_NATS,
)
from eagle3_data.nucleus import Item

QUANTILES = (0.01, 0.05, 0.25, 0.5)
TESTS = ("sampled", "pairs", "nucleus", "greedy")
# The outside-rate that matters for the nucleus test: 1 answer token in 100 outside the nucleus more
# than the local path's. A provider ignoring top_p 0.95 adds up to ~5 in 100 (the tail's mass); the
# test says UNDERPOWERED when its smallest detectable rate, for the tokens at hand, is above the
# local rate plus this.
NUCLEUS_RATE = 0.01


@dataclass(frozen=True)
class Thresholds:
    """The decision's settings (`validation.policy_shift_nats`, `policy_false_alarm_rate`,
    `policy_power`)."""

    shift: float = DEFAULT_POLICY_SHIFT_NATS
    false_alarm_rate: float = DEFAULT_POLICY_FALSE_ALARM_RATE
    power: float = DEFAULT_POLICY_POWER

    @property
    def tolerance(self) -> float:
        """The largest shift accepted as the same policy: half the one that matters, so that the
        power at the shift that matters is reached with finitely many samples."""
        return self.shift / 2

    @classmethod
    def from_config(cls, validation: Any) -> Thresholds:
        return cls(validation.policy_shift_nats, validation.policy_false_alarm_rate, validation.policy_power)


def sample_means(samples: Iterable[ArrayLike]) -> np.ndarray:
    """Each sample's mean per-token log-probability, empty samples left out."""
    return np.array([float(np.mean(a)) for a in (np.asarray(s, np.float64) for s in samples) if a.size], np.float64)


def _test(diff: float, se: float, df: float, n: tuple[int, ...], th: Thresholds, alpha: float) -> dict[str, Any]:
    """One minimum-effect test's figures: `diff` (nats/token, local minus overflow), its standard
    error and degrees of freedom; p-value of H0 |shift| <= tolerance (two one-sided tests, each at
    alpha / 2), rejected at `alpha`; the minimum detectable shift at `th.power`."""
    from scipy import stats

    crit = float(stats.t.ppf(1 - alpha / 2, df))
    if se > 0:
        p = min(1.0, 2 * float(stats.t.sf((abs(diff) - th.tolerance) / se, df)))
        mds = th.tolerance + (crit + float(stats.t.ppf(th.power, df))) * se
    else:  # every sample's mean identical on each side: the difference is exact
        p, mds = (0.0 if abs(diff) > th.tolerance else 1.0), th.tolerance
    return {
        "samples": list(n),
        "shift": diff,
        "standard_error": se,
        "df": df,
        "p_value": p,
        "alpha": alpha,
        "critical_shift": th.tolerance + crit * se,
        "rejected": p < alpha,
        "min_detectable_shift": mds,
        "underpowered": mds > th.shift,
    }


def _fisher_p(over_out: int, over_tokens: int, local_out: int, local_tokens: int) -> float:
    """One-sided Fisher exact p-value of H0 "the overflow's outside-rate is not above the local's"."""
    from scipy import stats

    table = [[over_out, over_tokens - over_out], [local_out, local_tokens - local_out]]
    return float(stats.fisher_exact(table, alternative="greater").pvalue)


def nucleus_test(counts: Mapping[str, Mapping[str, int]], alpha: float, power: float) -> dict[str, Any]:
    """The nucleus test on token counts (`counts[side]`: `tokens` checked, `outside` the nucleus;
    side local | overflow): overflow rate above local rate, one-sided Fisher exact at `alpha`.
    `min_detectable_rate`: the smallest true overflow outside-rate r it rejects with probability
    `power`, the local counts as observed: the rejection region is {b >= b*} (the p-value falls
    as the overflow's outside count b grows), so r solves P(Binomial(m, r) >= b*) = power, i.e.
    r = Beta.ppf(power, b*, m - b* + 1); None when no count of the m overflow tokens would reject.
    `underpowered`: that rate is above the local rate plus NUCLEUS_RATE."""
    from scipy import stats

    lo, ov = counts["local"], counts["overflow"]
    n, a, m, b = int(lo["tokens"]), int(lo["outside"]), int(ov["tokens"]), int(ov["outside"])
    p = _fisher_p(b, m, a, n)
    low, high = 0, m  # smallest b* in [0, m] that rejects: binary search on the monotone p-value
    if _fisher_p(m, m, a, n) >= alpha:
        b_star = None
    else:
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if _fisher_p(mid, m, a, n) < alpha else (mid + 1, high)
        b_star = low
    mdr = None if b_star is None else (0.0 if b_star == 0 else float(stats.beta.ppf(power, b_star, m - b_star + 1)))
    return {
        "tokens": [n, m],
        "outside": [a, b],
        "rates": [a / n if n else None, b / m if m else None],
        "p_value": p,
        "alpha": alpha,
        "rejected": p < alpha,
        "critical_outside": b_star,
        "min_detectable_rate": mdr,
        "underpowered": mdr is None or mdr > (a / n if n else 0.0) + NUCLEUS_RATE,
    }


def _welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if se > 0 else float(a.size + b.size - 2)
    return float(a.mean() - b.mean()), se, float(df)


def decide(
    local: ArrayLike,
    overflow: ArrayLike,
    pairs_local: ArrayLike,
    pairs_overflow: ArrayLike,
    th: Thresholds = Thresholds(),
    nucleus: Mapping[str, Mapping[str, int]] | None = None,
    greedy: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """The decision on per-sample means: `local`, `overflow` (sampled answers) and the calibration
    pairs (`pairs_local[i]`, `pairs_overflow[i]`: one prompt), and, where score_policy counted
    them, the nucleus counts (`nucleus[side]`: `tokens`, `outside`; `nucleus_test`) and the
    calibration answers' counts against the argmax (`greedy`, the same shape and test). A mean
    test needs 2 observations a side (a spread), a count test a checked token a side; one that
    cannot run is absent from `tests`. `rejected`: the tests that reject; `underpowered`: the
    sampled test is absent or cannot reach `th.power` at `th.shift` (the pairs alone cannot see a
    sampler's fault; the nucleus test states its own)."""
    a, b = np.asarray(local, np.float64), np.asarray(overflow, np.float64)
    pl, po = np.asarray(pairs_local, np.float64), np.asarray(pairs_overflow, np.float64)
    if pl.shape != po.shape:
        raise ValueError(f"calibration pairs: {pl.shape} local means vs {po.shape} overflow means")
    runs: dict[str, tuple[float, float, float, tuple[int, ...]]] = {}
    if a.size >= 2 and b.size >= 2:
        runs["sampled"] = (*_welch(a, b), (a.size, b.size))
    if pl.size >= 2:
        d = pl - po
        runs["pairs"] = (float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)), float(d.size - 1), (d.size,))
    counted = {
        name: c
        for name, c in (("nucleus", nucleus), ("greedy", greedy))
        if c and all(int((c.get(s) or {}).get("tokens") or 0) > 0 for s in SIDES)
    }
    alpha = th.false_alarm_rate / max(1, len(runs) + len(counted))
    tests = {name: _test(diff, se, df, n, th, alpha) for name, (diff, se, df, n) in runs.items()}
    tests.update({name: nucleus_test(c, alpha, th.power) for name, c in counted.items()})
    return {
        "tests": tests,
        "rejected": [t for t in TESTS if t in tests and tests[t]["rejected"]],
        "underpowered": "sampled" not in tests or tests["sampled"]["underpowered"],
        "thresholds": {
            "shift": th.shift,
            "tolerance": th.tolerance,
            "false_alarm_rate": th.false_alarm_rate,
            "power": th.power,
        },
    }


def _side(scores: Sequence[ArrayLike]) -> dict[str, Any]:
    """A side's figures: samples, tokens, the mean of its samples' means (equal weight per
    sample, the statistic's), the per-token quantiles (the tail: the likeliest garbage)."""
    means = sample_means(scores)
    tokens = np.concatenate([np.asarray(s, np.float64) for s in scores]) if len(scores) else np.zeros(0)
    return {
        "samples": int(means.size),
        "tokens": int(tokens.size),
        "mean_logprob": float(means.mean()) if means.size else None,
        "token_quantiles": {f"p{int(q * 100)}": float(np.quantile(tokens, q)) for q in QUANTILES}
        if tokens.size
        else {},
        "sample_means": [float(m) for m in means],
    }


def check(
    local: Sequence[ArrayLike],
    overflow: Sequence[ArrayLike],
    pairs: Sequence[tuple[ArrayLike, ArrayLike]] = (),
    th: Thresholds = Thresholds(),
) -> dict[str, Any]:
    """Figures and verdict from per-token log-probabilities: per sample, for each side's sampled
    answers, and (local, overflow) per calibration prompt. The source may be any (scoring
    requests, the extraction's forward) as long as both sides come from the same one. Returns
    the gate's verdict (`policy_gate`: passed, reasons, notes, decision) with its `figures`, the
    shape the validation report stores."""
    pairs = [(p, q) for p, q in pairs if np.size(p) and np.size(q)]
    figures = figures_of(local, overflow, pairs)
    return {**policy_gate(figures, th), "figures": figures}


def figures_of(
    local: Sequence[ArrayLike],
    overflow: Sequence[ArrayLike],
    pairs: Sequence[tuple[ArrayLike, ArrayLike]],
    pair_ids: Sequence[str] = (),
    identical: int | None = None,
) -> dict[str, Any]:
    """The figures the decision is made on (and the report shows): both sides, the calibration
    pairs' means, and `gap_nats_per_token` (the sampled test's statistic)."""
    sides = {"local": _side(local), "overflow": _side(overflow)}
    pl, po = sample_means(p for p, _ in pairs), sample_means(q for _, q in pairs)
    d = pl - po
    gap = (
        sides["local"]["mean_logprob"] - sides["overflow"]["mean_logprob"]
        if sides["local"]["samples"] and sides["overflow"]["samples"]
        else None
    )
    return {
        **sides,
        "gap_nats_per_token": gap,
        "pairs": {
            "samples": int(d.size),
            "sample_ids": list(pair_ids),
            "identical_ids": identical,
            "mean_difference": float(d.mean()) if d.size else None,
            "local_means": [float(x) for x in pl],
            "overflow_means": [float(x) for x in po],
        },
    }


def decide_figures(figures: Mapping[str, Any], th: Thresholds) -> dict[str, Any]:
    """`decide` on committed figures (`figures_of`, and `nucleus`, `greedy` where score_policy
    counted them)."""
    pairs = figures.get("pairs") or {}
    return decide(
        figures["local"]["sample_means"],
        figures["overflow"]["sample_means"],
        pairs.get("local_means") or [],
        pairs.get("overflow_means") or [],
        th,
        figures.get("nucleus"),
        figures.get("greedy"),
    )


def summarize(
    items: Sequence[Item], scores: Sequence[Sequence[float] | None], refused: dict[str, str]
) -> dict[str, Any]:
    """The scored items' figures: sampled answers per side (route "local" or "overflow"; greedy
    calibration answers never among them), and the calibration pairs (route "both", scored on
    both sides; `identical_ids`: how many of them gave the same ids on both paths)."""
    scored = [(it, s) for it, s in zip(items, scores) if s is not None and len(s)]
    pools = {side: [s for it, s in scored if it.side == side and it.route == side] for side in ("local", "overflow")}
    both = {
        side: {it.sample_id: (it, s) for it, s in scored if it.side == side and it.route == "both"}
        for side in ("local", "overflow")
    }
    pair_ids = sorted(set(both["local"]) & set(both["overflow"]))
    pairs = [(both["local"][i][1], both["overflow"][i][1]) for i in pair_ids]
    identical = sum(both["local"][i][0].ids == both["overflow"][i][0].ids for i in pair_ids)
    return {
        **figures_of(pools["local"], pools["overflow"], pairs, pair_ids, identical),
        "refused": dict(sorted(refused.items())[:20]),
        "refused_count": len(refused),
    }


WORST = 5  # samples a side the report shows, least likely first
WORST_TOKENS = 64  # of each, the answer's first tokens shown


def worst_samples(
    items: Sequence[Item], scores: Sequence[Sequence[float] | None], decode: Callable[[list[int]], str], k: int = WORST
) -> dict[str, list[dict[str, Any]]]:
    """Per side, the `k` scored answers least likely under the target (lowest mean log-probability
    per token): the likeliest garbage (another model's text, a broken reconstruction), for a
    person to read. Each with its route, and its first WORST_TOKENS answer tokens decoded one by
    one with the run's tokenizer (`decode`) beside their log-probabilities."""
    out: dict[str, list[dict[str, Any]]] = {}
    for side in ("local", "overflow"):
        scored = [
            (float(np.mean(s)), it, s) for it, s in zip(items, scores) if it.side == side and s is not None and len(s)
        ]
        out[side] = [
            {
                "sample_id": it.sample_id,
                "route": it.route,
                "mean_logprob": mean,
                "tokens": len(s),
                "texts": [decode([i]) for i in it.ids[it.first : it.first + WORST_TOKENS]],
                "logprobs": [float(x) for x in s[:WORST_TOKENS]],
            }
            for mean, it, s in sorted(scored, key=lambda x: (x[0], x[1].sample_id))[:k]
        ]
    return out


def required_samples(th: Thresholds, spread_local: float, spread_overflow: float, *, tests: int = 1) -> int:
    """Samples per side (equal on both) for the sampled test to reach `th.power` at `th.shift`,
    given the spreads (standard deviations) of each side's sample means, with the false-alarm
    rate split over `tests` tests: the smallest n with tolerance + (t(1 - a/2) + t(power)) *
    sqrt((s_l^2 + s_o^2) / n) <= shift, df as Welch's for n a side."""
    from scipy import stats

    alpha, v = th.false_alarm_rate / tests, spread_local**2 + spread_overflow**2
    if v == 0:
        return 2
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(th.power)
    n = max(2, math.ceil(v * (z / (th.shift - th.tolerance)) ** 2))
    while True:
        va, vb = spread_local**2 / n, spread_overflow**2 / n
        df = (va + vb) ** 2 / ((va**2 + vb**2) / (n - 1))
        t = stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(th.power, df)
        if th.tolerance + t * math.sqrt(v / n) <= th.shift:
            return n
        n += max(1, n // 50)


def sample_size(th: Thresholds, pilot: Mapping[str, Any], scored: int, max_samples: int) -> dict[str, Any]:
    """How many sampled answers a side to score, from a pilot's figures (`summarize` of what was
    scored, `scored` a side asked for): `required_samples` at the spreads of its sample means
    (alpha split when the pilot holds 2 or more calibration pairs), at least the pilot, at most
    `max_samples`. Only the spreads are used, never the means: the test keeps the false-alarm
    rate of a fixed size (an internal pilot, Wittes and Brittain 1990)."""
    spreads = {
        side: float(np.std(pilot[side]["sample_means"], ddof=1)) if pilot[side]["samples"] >= 2 else 0.0
        for side in ("local", "overflow")
    }
    tests = 2 if (pilot.get("pairs") or {}).get("samples", 0) >= 2 else 1
    need = required_samples(th, spreads["local"], spreads["overflow"], tests=tests)
    return {"pilot": scored, "spreads": spreads, "required": need, "chosen": max(scored, min(need, max_samples))}


def power_statement(decision: Mapping[str, Any]) -> str:
    """What the check could see, for the sample sizes at hand: per test, the smallest shift it
    detects with the configured power at its false-alarm rate, and whether that is above the
    shift that matters (underpowered)."""
    th = decision["thresholds"]
    parts = []
    for name, what, rate in (
        ("nucleus", "answer tokens", "an outside-rate"),
        ("greedy", "calibration answer tokens", "an off-argmax rate"),
    ):
        if (t := decision["tests"].get(name)) is None:
            continue
        mdr = t["min_detectable_rate"]
        seen = "no rate (too few tokens)" if mdr is None else f"{rate} of {mdr:.2%}"
        local = t["rates"][0] or 0.0
        short = f", UNDERPOWERED (above the local {local:.2%} + {NUCLEUS_RATE:.0%})" if t["underpowered"] else ""
        parts.append(
            f"{name} ({t['tokens'][0]} + {t['tokens'][1]} {what}): detects {seen} with "
            f"{th['power']:.0%} power at false-alarm rate {t['alpha']:.2g}{short}"
        )
    for name, what in (("sampled", "sampled answers"), ("pairs", "calibration pairs")):
        t = decision["tests"].get(name)
        if t is None:
            parts.append(f"{what}: not tested (fewer than 2 a side)")
            continue
        n = " + ".join(str(x) for x in t["samples"])
        short = f", UNDERPOWERED (larger than the shift that matters, {th['shift']:g})" if t["underpowered"] else ""
        parts.append(
            f"{what} ({n}): detects a shift of {t['min_detectable_shift']:.3f} nats/token with "
            f"{th['power']:.0%} power at false-alarm rate {t['alpha']:.2g}{short}"
        )
    if "nucleus" not in decision["tests"]:
        parts.append(
            "nucleus: not tested (the sampling has no nucleus to check: greedy, no top_p or top_k, or a "
            "penalty; or no checked answer token on a side; docs/generation.md)"
        )
    if "greedy" not in decision["tests"]:
        parts.append("greedy: not tested (no calibration answer scored on both sides: routing.calibration_samples)")
    return "; ".join(parts)


def policy_gate(summary: dict[str, Any] | None, th: Thresholds) -> dict[str, Any]:
    """The gate's verdict on the committed figures. Fails when a test rejects: the overflow text
    is shifted beyond the tolerance (less likely under the target: another model or other weights;
    more likely: a greedier sampler than the config's). Underpowered (the sampled test cannot
    see the shift that matters with the samples at hand): a note, not a failure: the shortfall
    is a property of how many overflow answers exist, not evidence against the provider, and
    failing on it would fail honest small datasets at any rate; the report flags it."""
    if summary is None:
        return {"passed": True, "reasons": [], "notes": ["policy not scored (no score_policy stage for this run)"]}
    if summary.get("skipped"):
        return {"passed": True, "reasons": [], "notes": [f"policy not checked: {summary['skipped']}"]}
    if summary["overflow"]["samples"] == 0 and (summary.get("pairs") or {}).get("samples", 0) == 0:
        return {"passed": True, "reasons": [], "notes": ["policy: no overflow answers to check"]}
    decision = decide_figures(summary, th)
    power = f"policy power: {power_statement(decision)}"
    short = (
        f"policy UNDERPOWERED: it cannot see a shift of {th.shift:g} nats/token with {th.power:.0%} "
        "power on these samples (score more: policy.max_samples, or more overflow answers)"
    )
    underpowered = [short] if decision["underpowered"] else []
    reasons = []
    for name in decision["rejected"]:
        t = decision["tests"][name]
        if name == "nucleus":
            reasons.append(
                "overflow text is off the target's policy, tokens outside the nucleus its sampling allows "
                f"(top_p/top_k after temperature): a provider ignoring top_p or top_k? {_figures(name, t, summary)}, "
                f"p = {t['p_value']:.2g} < {t['alpha']:.2g}"
            )
            continue
        if name == "greedy":
            reasons.append(
                "overflow text is off the target's weights, greedy calibration answers leave the target's argmax "
                f"where the local ones do not: other weights (a quantisation)? {_figures(name, t, summary)}, "
                f"p = {t['p_value']:.2g} < {t['alpha']:.2g}"
            )
            continue
        why = (
            "less likely under the target than its own text: another model or other weights?"
            if t["shift"] > 0
            else "more likely under the target than its own text: a greedier sampler than the config's?"
        )
        what = "sampled answers" if name == "sampled" else "calibration pairs (same prompt, greedy on both paths)"
        reasons.append(
            f"overflow text is off the target's policy, {why} {what}: {_figures(name, t, summary)}; "
            f"tolerance {th.tolerance:g} nats/token (half validation.policy_shift_nats {th.shift:g}), "
            f"p = {t['p_value']:.2g} < {t['alpha']:.2g}"
        )
    notes = [
        f"policy: {_figures(n, decision['tests'][n], summary)}, p = {decision['tests'][n]['p_value']:.2g}"
        for n in TESTS
        if n in decision["tests"] and n not in decision["rejected"]
    ]
    return {"passed": not reasons, "reasons": reasons, "notes": notes + [power] + underpowered, "decision": decision}


LOCAL_SOURCES, OVERFLOW_SOURCES = ("sglang", "vllm"), ("openrouter",)
SIDES = ("local", "overflow")


def nucleus_counts(sources: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int]] | None:
    """The extraction's per-source nucleus figures (`logprobs.sources[source].nucleus`) added up per
    path (local engines, the overflow provider); None when no source has any."""
    if not any((side or {}).get("nucleus") for side in sources.values()):
        return None
    out = {}
    for path, names in (("local", LOCAL_SOURCES), ("overflow", OVERFLOW_SOURCES)):
        found = [sources[s]["nucleus"] for s in names if (sources.get(s) or {}).get("nucleus")]
        out[path] = {k: sum(int(f[k]) for f in found) for k in ("samples", "tokens", "outside")}
    return out


def every_row_gate(
    means_by_source: Mapping[str, Sequence[float]],
    th: Thresholds,
    nucleus: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """The policy check on every merged row, once the extraction scored them all: the sampled
    test over each sampled answer's mean target log-probability per trained token (the
    extraction's, target_head.logprobs), local engines' answers against the overflow
    provider's. No calibration pairs here: a calibration prompt's overflow answer gave way to its
    local one in the merge. The same decision and tolerance as the scored check (`policy_gate`).

    The extraction's nucleus counts (`nucleus_counts`) are reported, not tested: a merged local
    row holds the engine's own ids, an overflow row the ids reconstruction made of its text, and
    where the text's canonical split differs from what was sampled (a re-split) the canonical
    token can lie outside the nucleus though the provider sampled honestly (4.1% of the tiny
    model's answer tokens at top_p 0.95; docs/generation.md). The gated nucleus test runs where
    both sides share one tokenisation path: score_policy's items (nucleus)."""

    def side(sources: Sequence[str]) -> dict[str, Any]:
        means = [float(m) for s in sources for m in means_by_source.get(s) or ()]
        return {
            "samples": len(means),
            "sample_means": means,
            "mean_logprob": float(np.mean(means)) if means else None,
            "token_quantiles": {},
        }

    gate = policy_gate({"local": side(LOCAL_SOURCES), "overflow": side(OVERFLOW_SOURCES), "pairs": {"samples": 0}}, th)
    if nucleus:
        lo, ov = nucleus["local"], nucleus["overflow"]
        gate["notes"].append(
            f"policy nucleus on every row (reported, not tested: local rows carry the engine's ids, overflow "
            f"rows reconstructed ones): outside the sampling's nucleus {lo['outside']} of {lo['tokens']} local "
            f"and {ov['outside']} of {ov['tokens']} overflow answer tokens"
        )
    return gate


def _figures(name: str, t: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    if name in ("nucleus", "greedy"):
        (n, m), (a, b) = t["tokens"], t["outside"]
        where = "outside" if name == "nucleus" else "not the target's argmax"
        return f"{name}: {b} of {m} overflow answer tokens {where} ({b / m:.2%}), local {a} of {n} ({a / n:.2%})"
    if name == "sampled":
        local, over = summary["local"], summary["overflow"]
        return (
            f"mean log-probability local {local['mean_logprob']:.3f}, overflow {over['mean_logprob']:.3f} "
            f"nats/token per sample (shift {t['shift']:+.3f} +- {t['standard_error']:.3f}) over "
            f"{local['samples']} + {over['samples']} samples"
        )
    pairs = summary["pairs"]
    return (
        f"calibration pairs: mean difference {t['shift']:+.3f} +- {t['standard_error']:.3f} nats/token over "
        f"{pairs['samples']} prompts ({pairs['identical_ids']} gave the same ids on both paths)"
    )


def rows(items: Iterable[Item], scores: Iterable[Sequence[float] | None], dataset: str) -> list[dict[str, Any]]:
    """The scored samples as `schemas.POLICY_SCORES` rows (refused ones left out)."""
    return [
        {
            "sample_id": it.sample_id,
            "dataset": dataset,
            "side": it.side,
            "route": it.route,
            "scored_tokens": len(s),
            "logprobs": [float(x) for x in s],
        }
        for it, s in zip(items, scores)
        if s is not None
    ]
