"""The overflow share's checks: billed completion tokens against the reconstructed ids, and billed
prompt tokens against the prompt ids we train on."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from eagle3_data.gate_defaults import (
    DEFAULT_MAX_BILLING_DEVIATION,
    DEFAULT_MAX_MISSING_USAGE_RATE,
    DEFAULT_MAX_PROMPT_BILLING_MEAN_ABS_DIFF,
    DEFAULT_MAX_PROMPT_BILLING_ROW_DIFF,
    DEFAULT_MAX_PROMPT_BILLING_ROW_RATE,
)
from eagle3_data.stages.validate.gate import EXAMPLES


@dataclass
class _Missing:
    """Rows whose billed count is missing (the answer had no `usage`): counted and a few named,
    never taken as 0 tokens; more of them than the gate's rate fails it (with every count missing
    there is nothing to compare, which must not read as no difference)."""

    rows: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, sample_id: str) -> None:
        self.rows += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(sample_id)

    def figures(self, compared: int) -> dict[str, Any]:
        checked = compared + self.rows
        return {"rows": self.rows, "rate": self.rows / checked if checked else 0.0, "examples": self.examples}

    def reason(self, compared: int, what: str, max_rate: float, *, others: int = 0) -> str | None:
        """`what` says what these rows lack ("have no usage.completion_tokens"); `others`: rows
        of another uncounted kind, checked beside these (so the rate is of all rows checked)."""
        checked = compared + self.rows + others
        rate = self.rows / checked if checked else 0.0
        if not self.rows or rate <= max_rate:
            return None
        return (
            f"{self.rows} row(s) ({rate:.2%}) {what}, above max_missing_usage_rate "
            f"{max_rate:.2%} (e.g. {', '.join(self.examples[:3])})"
        )


def _zero_what(usage_field: str, ours: str) -> str:
    return f"billed 0 {usage_field} for {ours}"


def _keep_worst(top: list[tuple[Any, ...]], item: tuple[Any, ...], worst: int) -> None:
    """Keep the `worst` largest items (by their first field) of a stream in a min-heap."""
    if len(top) < worst:
        heapq.heappush(top, item)
    else:
        heapq.heappushpop(top, item)


def compare_billed_counts(
    rows: Iterable[tuple[str, int | None, int] | tuple[str, int | None, int, str | None]],
    *,
    max_aggregate_deviation: float = DEFAULT_MAX_BILLING_DEVIATION,
    max_missing_usage_rate: float = DEFAULT_MAX_MISSING_USAGE_RATE,
    worst: int = 20,
) -> dict[str, Any]:
    """OpenRouter's `usage.completion_tokens` vs reconstructed lengths, per (sample_id, billed,
    reconstructed[, unreconstructable reason]). The provider counted with the model's own
    tokenizer, so an aggregate gap means reconstruction (or the provider's text) differs
    systematically; gate on it. Rows with a reason (text that cannot determine the ids, see
    `reconstruct.unreconstructable_reason`) would show a gap that says nothing about
    reconstruction: they are counted under `excluded` and left out of the deviation. A row whose
    billed count is missing (None: the answer had no `usage`) is counted under `missing_usage`,
    never as 0 tokens, and more of them than `max_missing_usage_rate` fails the gate: with every
    count missing there is nothing to compare, which must not read as a deviation of 0. A billed
    count of 0 on a row with reconstructed tokens is no count either (a provider whose usage
    says 0 on every row made the billed total 0, and the deviation read 0): counted under
    `zero_usage`, named, left out of the deviation and gated at the same rate."""
    billed_total = rebuilt_total = n = 0
    abs_sum = 0.0
    top: list[tuple[float, str, int, int]] = []
    excluded: dict[str, Any] = {"rows": 0, "billed_completion_tokens": 0, "reasons": {}}
    missing = _Missing()
    zero = _Missing()

    for sample_id, billed, rebuilt, *reason in rows:
        if reason and reason[0]:
            excluded["rows"] += 1
            excluded["billed_completion_tokens"] += billed or 0
            excluded["reasons"][reason[0]] = excluded["reasons"].get(reason[0], 0) + 1
            continue
        if billed is None:
            missing.add(sample_id)
            continue
        if billed <= 0 and rebuilt > 0:
            zero.add(sample_id)
            continue
        n += 1
        billed_total += billed
        rebuilt_total += rebuilt
        dev = (rebuilt - billed) / billed if billed else (0.0 if rebuilt == 0 else 1.0)
        abs_sum += abs(dev)
        _keep_worst(top, (abs(dev), sample_id, billed, rebuilt), worst)
    aggregate = (rebuilt_total - billed_total) / billed_total if billed_total else 0.0
    reasons = []
    if abs(aggregate) > max_aggregate_deviation:
        reasons.append(f"aggregate deviation {aggregate:+.4%} exceeds ±{max_aggregate_deviation:.2%}")
    if why := missing.reason(n, "have no usage.completion_tokens", max_missing_usage_rate, others=zero.rows):
        reasons.append(why)
    zero_what = _zero_what("completion_tokens", "a non-empty answer")
    if why := zero.reason(n, zero_what, max_missing_usage_rate, others=missing.rows):
        reasons.append(why)
    notes = [
        f"{count} row(s) excluded from the deviation and from training data, unreconstructable: {why}"
        for why, count in sorted(excluded["reasons"].items())
    ]
    return {
        "rows": n,  # faithful rows: the ones the deviation is computed over
        "excluded": excluded,
        "missing_usage": missing.figures(n + zero.rows),
        "zero_usage": zero.figures(n + missing.rows),
        "billed_completion_tokens": billed_total,
        "reconstructed_completion_tokens": rebuilt_total,
        "deviation": aggregate,
        "mean_abs_sample_deviation": abs_sum / n if n else 0.0,
        "worst_samples": [
            {"sample_id": s, "billed": b, "reconstructed": r, "deviation": (r - b) / b if b else None}
            for _, s, b, r in sorted(top, reverse=True)
        ],
        "gate": {
            "passed": not reasons,
            "reasons": reasons,
            "notes": notes,
            "max_aggregate_deviation": max_aggregate_deviation,
            "max_missing_usage_rate": max_missing_usage_rate,
        },
    }


PROMPT_DIFF_BINS = 8  # the distribution keeps each difference up to ±this many tokens, and two tails


def compare_billed_prompts(
    rows: Iterable[tuple[str, int | None, int]],
    *,
    max_mean_abs_diff: float = DEFAULT_MAX_PROMPT_BILLING_MEAN_ABS_DIFF,
    max_row_diff: int = DEFAULT_MAX_PROMPT_BILLING_ROW_DIFF,
    max_row_rate: float = DEFAULT_MAX_PROMPT_BILLING_ROW_RATE,
    max_missing_usage_rate: float = DEFAULT_MAX_MISSING_USAGE_RATE,
    worst: int = 20,
) -> dict[str, Any]:
    """OpenRouter's `usage.prompt_tokens` vs len(prompt_ids), per (sample_id, billed, ours) of each
    overflow answer. The provider counts with the model's own tokenizer; when it rendered the
    prompt we train on, the two are equal. A provider that renders another prompt (a system
    prompt of its own, tools declared another way, earlier reasoning dropped) answered another
    question than the one the record pairs with the answer, and shows here as a difference on
    every row: the mean absolute difference (tokens per answer) and each row's difference are
    gated, the rows over `max_row_diff` named with their gap. Cached prompt tokens
    (`prompt_tokens_details.cached_tokens`) are a part of prompt_tokens, priced lower, not
    another count: nothing to subtract. A missing count (None) is counted as missing, never as 0;
    a count of 0 for a prompt with ids is no count either (counted under `zero_usage`, named,
    left out of the differences and gated like a missing one), not a gap of the prompt's length."""
    n = billed_total = ours_total = abs_sum = 0
    diff_sum = 0
    bins: dict[int, int] = {}
    top: list[tuple[int, str, int, int]] = []
    over: list[dict[str, Any]] = []
    over_rows = 0
    missing = _Missing()
    zero = _Missing()
    for sample_id, billed, ours in rows:
        if billed is None:
            missing.add(sample_id)
            continue
        if billed <= 0 and ours > 0:
            zero.add(sample_id)
            continue
        n += 1
        billed_total += billed
        ours_total += ours
        diff = billed - ours
        diff_sum += diff
        abs_sum += abs(diff)
        key = max(-PROMPT_DIFF_BINS - 1, min(PROMPT_DIFF_BINS + 1, diff))
        bins[key] = bins.get(key, 0) + 1
        if abs(diff) > max_row_diff:
            over_rows += 1
            if len(over) < EXAMPLES:
                over.append({"sample_id": sample_id, "billed": billed, "ours": ours, "diff": diff})
        _keep_worst(top, (abs(diff), sample_id, billed, ours), worst)
    mean_abs = abs_sum / n if n else 0.0
    over_rate = over_rows / n if n else 0.0
    reasons = []
    if mean_abs > max_mean_abs_diff:
        reasons.append(
            f"billed prompt tokens differ from the prompt ids by {mean_abs:.2f} tokens per answer on average "
            f"(mean {diff_sum / n:+.2f}; {billed_total:,} billed, {ours_total:,} ours over {n} answers), "
            f"above max_prompt_billing_mean_abs_diff {max_mean_abs_diff:g}: the provider rendered another prompt"
        )
    if over_rows and over_rate > max_row_rate:
        named = ", ".join(f"{o['sample_id']} ({o['diff']:+d})" for o in over[:5])
        reasons.append(
            f"{over_rows} answer(s) ({over_rate:.2%}) billed more than {max_row_diff} prompt tokens away from "
            f"their prompt ids, above max_prompt_billing_row_rate {max_row_rate:.2%}: {named}"
        )
    if why := missing.reason(n, "have no usage.prompt_tokens", max_missing_usage_rate, others=zero.rows):
        reasons.append(why)
    if why := zero.reason(
        n, _zero_what("prompt_tokens", "a non-empty prompt"), max_missing_usage_rate, others=missing.rows
    ):
        reasons.append(why)
    labels = {-PROMPT_DIFF_BINS - 1: f"<= {-PROMPT_DIFF_BINS - 1}", PROMPT_DIFF_BINS + 1: f">= +{PROMPT_DIFF_BINS + 1}"}
    return {
        "rows": n,
        "billed_prompt_tokens": billed_total,
        "prompt_ids_tokens": ours_total,
        "mean_diff": diff_sum / n if n else 0.0,
        "mean_abs_diff": mean_abs,
        # billed - ours: each difference's count, in order (the tails gather the rest)
        "diff_distribution": [[labels.get(k, f"{k:+d}" if k else "0"), bins[k]] for k in sorted(bins)],
        "over_tolerance": {"rows": over_rows, "rate": over_rate, "examples": over},
        "missing_usage": missing.figures(n + zero.rows),
        "zero_usage": zero.figures(n + missing.rows),
        "worst_samples": [
            {"sample_id": s, "billed": b, "ours": o, "diff": b - o} for _, s, b, o in sorted(top, reverse=True)
        ],
        "gate": {
            "passed": not reasons,
            "reasons": reasons,
            "max_mean_abs_diff": max_mean_abs_diff,
            "max_row_diff": max_row_diff,
            "max_row_rate": max_row_rate,
            "max_missing_usage_rate": max_missing_usage_rate,
        },
    }
