"""The nucleus test's counts from the local engine's own scoring request: no target in memory.

Each scoring request (`Wire.score_request` with `top_logprobs` K) returns, at every answer position,
the log-probability of the token there and the K largest log-probabilities of the target's
*unscaled* distribution there: vLLM's `prompt_logprobs: K` (log_softmax of the raw logits in fp32
whatever `--logprobs-mode`, engines/vllm.py), SGLang's `top_logprobs_num: K` as
`meta_info.input_top_logprobs` (log_softmax of the raw logits, engines/sglang.py). From those
alone `outside` decides, per answer token, whether it is *provably* outside the nucleus the run's
sampling allowed (temperature T, top_p p, top_k k; `Nucleus` below; both engines
truncate softmax(logits / T): a token sampled honestly has less than p of that distribution
strictly above it, and fewer than k tokens above it, target_head/logprobs.py says where).

The bound. Let p_j be the raw probabilities, a = 1/T, so the sampler's distribution is
q_j = p_j^a / Z with Z = sum_j p_j^a. Call A the tokens of the top-K whose log-probability exceeds
the token's own by more than `logit_margin`. Every token above the token is in the top-K when the
token is (so A is then exactly the tokens clearly above it); when it is below the top-K, the top-K
all lie above it and A is a subset of those. Either way q(A) >= sum_A p_j^a / Z_max, where Z_max
bounds Z from above from the top-K alone: Z = sum_topK p_j^a + sum_rest p_j^a, the rest (V - K
tokens, each at most p_K, the smallest of the top-K, together R = 1 - sum_topK p_j) bounded by
- T = 1: R exactly (Z = 1);
- T < 1 (a > 1): p_j^a = p_j * p_j^(a-1) <= p_j * p_K^(a-1), so at most R * p_K^(a-1);
- T > 1 (a < 1): p^a is concave, so R spread evenly is the worst: (V - K) * (R / (V - K))^a,
  V the vocabulary size (the tokenizer's: an LM head wider than it would need its own V).
R is taken as max(0, 1 - sum_topK p_j) + R_SLACK: the engine's fp32 log-probabilities are rounded
(its log-normaliser over 163840 logits, the K values), and an R rounded down would shrink Z_max.

The token is outside when that lower bound of q(A) reaches top_p + MASS_MARGIN with room for the
engines' numerics: the provider's (or the local engine's) logits at generation and the scoring
engine's at prefill differ, each by at most delta = `logit_margin` / 2 (other kernels, batch
shapes, bf16). A token above by more than 2 delta at scoring is above at generation, and the odds
q(A) / (1 - q(A)) of any set move by at most exp(2 delta a) between the two; so the rule asks for
odds(q(A)) >= odds(top_p + MASS_MARGIN) * exp(logit_margin * a). Or, with top_k, when k or more
tokens of the top-K are clearly above it. Both only ever count a token as inside: an honest token
is never counted outside (tests/unit/test_policy_nucleus_topk.py checks the rule against the exact
one on full logits). What the bound costs is power: a token outside a nucleus wider than the top-K
is counted inside. On a trained model the nucleus is mostly a few tokens; on the tiny random
target it holds hundreds (`eagle3_devtools.vllm_serve.MAX_LOGPROBS`).

Both sides are counted by the same rule on the same tokenisation path (the local answers on the
validator's rebuild of their ids, `select.local_items`), so an honest provider's outside-rate is
the local engine's, and the one-sided Fisher test (`compare.nucleus_test`) keeps its false-alarm
rate; only sampled answers count (a calibration answer is greedy: its route is "both"). The
calibration answers are counted apart, against the target's argmax (`off_argmax`), for the greedy test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The nucleus test's numeric margins. A token counts as outside the nucleus only when the mass of the
# tokens whose logit exceeds its own by more than LOGIT_MARGIN (the engine's and the extraction's logits
# differ by rounding: per compute dtype, ~1e-5 in fp32 measured on vLLM CPU, one rounding of a logit of
# ~30 for the half dtypes) is at least top_p + MASS_MARGIN (the cumulative sums' float32 rounding over
# 163840 probabilities), or when at least top_k tokens exceed it so. Both margins only ever make a
# token count as inside: an honest token is never counted outside for rounding alone.
LOGIT_MARGIN = {"float32": 1e-3, "float16": 0.03, "bfloat16": 0.15}
MASS_MARGIN = 0.005
# sampling keys that move the distribution before the truncation (a penalty's effect depends on what
# came before): rows sampled with any away from its neutral value are not checked
_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True)
class Nucleus:
    """The truncation a sampled answer was drawn under: temperature, top_p, top_k (<= 0: none)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, sampling: Mapping[str, Any] | None) -> Nucleus | None:
        """From a generation row's `provenance.sampling`; None when there is nothing to check: a
        greedy answer (temperature 0: the calibration pairs), no truncation (top_p 1, no top_k), or
        a penalty that reshapes the distribution before the truncation (not reproducible from the
        logits alone)."""
        sampling = sampling or {}
        t = float(sampling.get("temperature") or 0.0)
        top_p, top_k = float(sampling.get("top_p", 1.0) or 1.0), int(sampling.get("top_k", -1) or -1)
        if t <= 0 or (top_p >= 1.0 and top_k <= 0):
            return None
        if any(sampling.get(k) is not None and float(sampling[k]) != neutral for k, neutral in _PENALTIES.items()):
            return None
        return cls(t, top_p, top_k)


# The generating and the scoring engine's logits differ by rounding and kernels: by default the bf16
# margin (one rounding of a logit of ~30), whatever the local engine's dtype, since an honest
# provider's engine may run another (`policy.nucleus_logit_margin`).
ENGINE_LOGIT_MARGIN = LOGIT_MARGIN["bfloat16"]
R_SLACK = 1e-4  # added to the rest mass 1 - sum(top-K): fp32 rounding of the engine's K values and normaliser


def outside(
    own: Sequence[float] | np.ndarray,
    top: Sequence[Sequence[float]] | np.ndarray,
    nucleus: Nucleus,
    vocab_size: int,
    logit_margin: float = ENGINE_LOGIT_MARGIN,
) -> np.ndarray:
    """bool [n]: whether the token whose raw log-probability is `own[i]` lies provably outside the
    nucleus of `nucleus`, from `top[i]`, the K largest raw log-probabilities at its position
    (any order; -inf or NaN pad a short row). The bound and the margins: module docstring."""
    own = np.asarray(own, np.float64)
    top = np.asarray(top, np.float64).reshape(own.size, -1)
    top = np.where(np.isnan(top), -np.inf, top)
    n, k = top.shape
    if n == 0 or k == 0:
        return np.zeros(n, dtype=bool)
    a = 1.0 / nucleus.temperature
    above = top > own[:, None] + logit_margin
    far = np.zeros(n, dtype=bool)
    if nucleus.top_p < 1.0:
        from scipy.special import logsumexp

        log_num = logsumexp(np.where(above, a * top, -np.inf), axis=1)
        log_top = logsumexp(a * top, axis=1)
        rest = np.maximum(0.0, 1.0 - np.exp(top).sum(axis=1)) + R_SLACK
        smallest = top.min(axis=1)  # log p_K (-inf where a row is padded: no bound from it, see below)
        if a == 1.0:
            log_rest = np.log(rest)
        elif a > 1.0:
            log_rest = np.log(rest) + (a - 1.0) * np.where(np.isfinite(smallest), smallest, 0.0)
        else:
            others = max(vocab_size - k, 1)
            log_rest = (1.0 - a) * math.log(others) + a * np.log(rest)
        mass = np.exp(log_num - np.logaddexp(log_top, log_rest))
        t = min(nucleus.top_p + MASS_MARGIN, 1.0)
        if t < 1.0:
            needed = t / (1.0 - t) * math.exp(logit_margin * a)
            with np.errstate(divide="ignore"):
                far |= mass / (1.0 - mass) >= needed
    if nucleus.top_k > 0:
        far |= above.sum(axis=1) >= nucleus.top_k
    return far


def off_argmax(
    own: Sequence[float] | np.ndarray,
    top: Sequence[Sequence[float]] | np.ndarray,
    logit_margin: float,
    max_gap: float,
) -> np.ndarray:
    """bool [n]: whether a greedy answer's token (the calibration prompts, temperature 0 on both
    paths), raw log-probability `own[i]`, is provably not the target's argmax yet within `max_gap`
    of it: the largest of `top[i]` (K >= 1 suffices: the argmax's) exceeds it by more than
    `logit_margin` (the engines' numerics, as in `outside`) and at most `max_gap`. The greedy test
    counts these (policy_check.py, "greedy"). Why the window: weights other than the target's (a
    quantisation) leave the argmax where their logits reorder a near-tie, so by about their logit
    error; a re-split token (the canonical split of text the engine split otherwise, alike on both
    paths) is another token altogether and often lies far below, so leaving those out lowers the
    honest rate and raises the test's power (on the tiny random target, 16 calibration answers of
    32 tokens: 18% of an honest answer's re-encoded tokens in (1e-3, 1] against 39% above 1e-3;
    an int8-rounded copy's flips lie 0.125-0.5 below; benchmarks/policy_power.py)."""
    own, top = np.asarray(own, np.float64), np.asarray(top, np.float64)
    if own.size == 0 or top.size == 0:
        return np.zeros(own.size, dtype=bool)
    top = top.reshape(own.size, -1)
    gap = np.nanmax(np.where(np.isnan(top), -np.inf, top), axis=1) - own
    return (gap > logit_margin) & (gap <= max_gap)


def nucleus_counts(
    items: Sequence[Item], outside_counts: Sequence[int | None], greedy: bool = False
) -> dict[str, dict[str, int]]:
    """Per side (local, overflow): the answers checked, their answer tokens, and those outside
    the nucleus (`outside_counts[i]`: item i's, None where it was not scored or not checked):
    the sampled answers, or with `greedy` the calibration answers (route "both", `off_argmax`)."""
    counts = {side: {"samples": 0, "tokens": 0, "outside": 0} for side in ("local", "overflow")}
    for it, k in zip(items, outside_counts):
        if k is None or it.route != ("both" if greedy else it.side) or len(it.ids) <= it.first:
            continue
        side = counts[it.side]
        side["samples"] += 1
        side["tokens"] += len(it.ids) - it.first
        side["outside"] += int(k)
    return counts


@dataclass(frozen=True)
class Item:
    """One sample to score: the log-probability of `ids[first:]` (the answer) after `ids[:first]`
    (its prompt)."""

    sample_id: str
    side: str  # "local" | "overflow"
    route: str  # "local" | "overflow" | "both" (calibration: greedy on both paths)
    ids: tuple[int, ...]
    first: int
    images: str | None = None  # an image prompt's references (the row's `images` JSON), None for text
