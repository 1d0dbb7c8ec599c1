"""The policy check's figures (per side: tokens, mean, tail quantiles) and its decision."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from eagle3_data.policy.select import Item

QUANTILES = (0.01, 0.05, 0.25, 0.5)


def _side(scores: Sequence[Sequence[float]]) -> dict[str, Any]:
    tokens = np.concatenate([np.asarray(s, np.float64) for s in scores]) if scores else np.zeros(0)
    means = [float(np.mean(s)) for s in scores if len(s)]
    return {
        "samples": len(means),
        "tokens": int(tokens.size),
        "mean_logprob": float(tokens.mean()) if tokens.size else None,
        "quantiles": {f"p{int(q * 100)}": float(np.quantile(tokens, q)) for q in QUANTILES} if tokens.size else {},
        "sample_means": means,
    }


def summarize(items: Sequence[Item], scores: Sequence[Sequence[float] | None], refused: dict[str, str]) -> dict[str, Any]:
    """Both sides' figures and the two-sample test over their samples' mean log-probabilities
    (Kolmogorov-Smirnov, two-sided; Mann-Whitney U beside it). `gap`: local minus overflow mean
    log-probability per token, in nats: positive when the overflow text is less likely under the
    target than the target's own."""
    from scipy import stats

    sides = {}
    for side in ("local", "overflow"):
        sides[side] = _side([s for it, s in zip(items, scores) if it.side == side and s is not None])
        sides[side]["calibration_samples"] = sum(it.side == side and it.route == "both" and s is not None
                                                 for it, s in zip(items, scores))
    a, b = sides["local"]["sample_means"], sides["overflow"]["sample_means"]
    test = None
    if len(a) >= 2 and len(b) >= 2:
        ks = stats.ks_2samp(a, b)
        mw = stats.mannwhitneyu(a, b, alternative="two-sided")
        test = {"ks_statistic": float(ks.statistic), "ks_p_value": float(ks.pvalue),
                "mannwhitney_p_value": float(mw.pvalue)}
    gap = (sides["local"]["mean_logprob"] - sides["overflow"]["mean_logprob"]
           if sides["local"]["mean_logprob"] is not None and sides["overflow"]["mean_logprob"] is not None else None)
    return {"local": sides["local"], "overflow": sides["overflow"], "gap_nats_per_token": gap, "test": test,
            "refused": dict(sorted(refused.items())[:20]), "refused_count": len(refused)}


def policy_gate(summary: dict[str, Any] | None, *, max_gap: float, max_p_value: float, min_samples: int) -> dict[str, Any]:
    """Fail when the overflow text is off the target's policy: the mean log-probability gap beyond
    `max_gap` nats per token (either way: less likely is another model; more likely, a greedier
    sampler than the config's) AND the two-sample test significant at `max_p_value`. Too few
    samples on a side to tell: a note, not a pass nor a failure."""
    if summary is None:
        return {"passed": True, "reasons": [], "notes": ["policy not scored (no score_policy stage for this run)"]}
    if summary.get("skipped"):
        return {"passed": True, "reasons": [], "notes": [f"policy not checked: {summary['skipped']}"]}
    local, over = summary["local"], summary["overflow"]
    if over["samples"] == 0:
        return {"passed": True, "reasons": [], "notes": ["policy: no overflow answers to check"]}
    if min(local["samples"], over["samples"]) < min_samples:
        return {"passed": True, "reasons": [], "notes": [
            f"policy not checked: {local['samples']} local and {over['samples']} overflow samples scored, fewer than "
            f"validation.policy_min_samples {min_samples} on a side"]}
    gap, p = summary["gap_nats_per_token"], summary["test"]["ks_p_value"]
    figures = (f"mean log-probability local {local['mean_logprob']:.3f}, overflow {over['mean_logprob']:.3f} nats/token "
               f"(gap {gap:+.3f}; p5 {local['quantiles']['p5']:.2f} vs {over['quantiles']['p5']:.2f}), KS p = {p:.2g} over "
               f"{local['samples']} + {over['samples']} samples")
    if abs(gap) > max_gap and p < max_p_value:
        why = ("less likely under the target than its own text: another model or other weights?" if gap > 0 else
               "more likely under the target than its own text: a greedier sampler than the config's?")
        return {"passed": False, "reasons": [f"overflow text is off the target's policy, {why} {figures}; limits "
                                             f"max_policy_logprob_gap {max_gap}, policy_max_p_value {max_p_value}"],
                "notes": []}
    return {"passed": True, "reasons": [], "notes": [f"policy: {figures}"]}


def rows(items: Iterable[Item], scores: Iterable[Sequence[float] | None], dataset: str) -> list[dict]:
    """The scored samples as `schemas.POLICY_SCORES` rows (refused ones left out)."""
    return [{"sample_id": it.sample_id, "dataset": dataset, "side": it.side, "route": it.route,
             "scored_tokens": len(s), "logprobs": [float(x) for x in s]}
            for it, s in zip(items, scores) if s is not None]
