"""The overflow share's check: billed completion tokens against the reconstructed ids."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from eagle3_data.gate_defaults import DEFAULT_MAX_BILLING_DEVIATION, DEFAULT_MAX_MISSING_USAGE_RATE
from eagle3_data.validate.gate import EXAMPLES


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
    count missing there is nothing to compare, which must not read as a deviation of 0."""
    billed_total = rebuilt_total = n = 0
    abs_sum = 0.0
    top: list[tuple[float, str, int, int]] = []
    excluded: dict[str, Any] = {"rows": 0, "billed_completion_tokens": 0, "reasons": {}}
    missing: list[str] = []
    missing_rows = 0

    for sample_id, billed, rebuilt, *reason in rows:
        if reason and reason[0]:
            excluded["rows"] += 1
            excluded["billed_completion_tokens"] += billed or 0
            excluded["reasons"][reason[0]] = excluded["reasons"].get(reason[0], 0) + 1
            continue
        if billed is None:
            missing_rows += 1
            if len(missing) < EXAMPLES:
                missing.append(sample_id)
            continue
        n += 1
        billed_total += billed
        rebuilt_total += rebuilt
        dev = (rebuilt - billed) / billed if billed else (0.0 if rebuilt == 0 else 1.0)
        abs_sum += abs(dev)
        item = (abs(dev), sample_id, billed, rebuilt)
        if len(top) < worst:
            heapq.heappush(top, item)
        else:
            heapq.heappushpop(top, item)
    aggregate = (rebuilt_total - billed_total) / billed_total if billed_total else 0.0
    reasons = []
    if abs(aggregate) > max_aggregate_deviation:
        reasons.append(f"aggregate deviation {aggregate:+.4%} exceeds ±{max_aggregate_deviation:.2%}")
    checked = n + missing_rows
    missing_rate = missing_rows / checked if checked else 0.0
    if missing_rows and missing_rate > max_missing_usage_rate:
        reasons.append(f"{missing_rows} row(s) ({missing_rate:.2%}) have no usage.completion_tokens, above "
                       f"max_missing_usage_rate {max_missing_usage_rate:.2%} (e.g. {', '.join(missing[:3])})")
    notes = [
        f"{count} row(s) excluded from the deviation and from training data, unreconstructable: {why}"
        for why, count in sorted(excluded["reasons"].items())
    ]
    return {
        "rows": n,  # faithful rows: the ones the deviation is computed over
        "excluded": excluded,
        "missing_usage": {"rows": missing_rows, "rate": missing_rate, "examples": missing},
        "billed_completion_tokens": billed_total,
        "reconstructed_completion_tokens": rebuilt_total,
        "deviation": aggregate,
        "mean_abs_sample_deviation": abs_sum / n if n else 0.0,
        "worst_samples": [
            {"sample_id": s, "billed": b, "reconstructed": r, "deviation": (r - b) / b if b else None}
            for _, s, b, r in sorted(top, reverse=True)
        ],
        "gate": {"passed": not reasons, "reasons": reasons, "notes": notes, "max_aggregate_deviation": max_aggregate_deviation,
                 "max_missing_usage_rate": max_missing_usage_rate},
    }
