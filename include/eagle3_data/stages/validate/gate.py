"""The local round-trip gate: per-row results summed into the report, and the decision."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3_data.chat_format import OutputFormat
from eagle3_data.gate_defaults import DEFAULT_MAX_BAD_ROW_RATE, DEFAULT_MAX_BPE_MISMATCH_RATE
from eagle3_data.mismatch.classify import CLASSES, FAILING_CLASSES, RowResult
from eagle3_data.mismatch.pool import validate_rows
from eagle3_data.mismatch.rows import BadRow, InputRow
from eagle3_data.mismatch.stops import StopConvention, detect_stop_convention

if TYPE_CHECKING:
    import pyarrow as pa

EXAMPLES = 20  # sample_ids kept per reported case


@dataclass
class ValidationSummary:
    """Accumulates per-row results into the report; holds only the mismatches, not every row.

    The gate cannot pass on nothing: no samples fail it unless `allow_unvalidated_overflow`
    (then the report warns that the overflow share goes unvalidated), and bad rows count
    against `max_bad_row_rate` (default 0)."""

    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE
    stops: StopConvention | None = None
    max_bad_row_rate: float = DEFAULT_MAX_BAD_ROW_RATE
    allow_unvalidated_overflow: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    details: dict[str, Counter[str]] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    literal_samples: int = 0
    literal_exact: int = 0
    literal_names: Counter[str] = field(default_factory=Counter)
    literal_examples: list[str] = field(default_factory=list)
    output_tokens: int = 0
    agreed_tokens: int = 0

    def add(self, item: RowResult | BadRow) -> None:
        if isinstance(item, BadRow):
            self.bad_rows.append(item.to_json())
            return
        self.counts[item.cls] += 1
        self.output_tokens += item.output_tokens
        self.agreed_tokens += item.agreed_tokens
        if item.detail:
            self.details.setdefault(item.cls, Counter())[item.detail] += 1
        if item.literal_special:
            self.literal_samples += 1
            self.literal_exact += item.cls == "exact"
            self.literal_names.update(item.literal_special)
            if len(self.literal_examples) < EXAMPLES:
                self.literal_examples.append(item.sample_id)
        if item.cls != "exact":
            self.mismatches.append(item.mismatch_json())

    def report(self) -> dict[str, Any]:
        samples = sum(self.counts.values())
        reasons, warnings = [], []
        for cls in FAILING_CLASSES:
            if self.counts[cls]:
                top = self.details.get(cls, Counter()).most_common(2)
                why = f" ({'; '.join(f'{n}x {d}' for d, n in top)})" if top else ""
                reasons.append(f"{self.counts[cls]} sample(s) classified {cls}{why}")
        bpe_rate = self.counts["bpe_only"] / samples if samples else 0.0
        if bpe_rate > self.max_bpe_mismatch_rate:
            reasons.append(f"bpe_only rate {bpe_rate:.4f} exceeds {self.max_bpe_mismatch_rate}")
        reasons += bad_row_reasons(len(self.bad_rows), samples, self.max_bad_row_rate)
        if not samples:
            if self.allow_unvalidated_overflow:
                warnings.append(
                    "no local samples: the overflow share goes UNVALIDATED "
                    "(validation.allow_unvalidated_overflow is set for this dataset)"
                )
            else:
                reasons.append(
                    "no local samples to validate: the overflow share cannot be trusted "
                    "(set validation.allow_unvalidated_overflow to accept that)"
                )
        if self.stops is not None:
            if failure := self.stops.failure():
                reasons.append(failure)
            if warning := self.stops.warning():
                warnings.append(warning)
        return {
            "samples": samples,
            "counts": dict(self.counts),
            "details": {cls: dict(c) for cls, c in self.details.items()},
            "sample_mismatch_rate": (samples - self.counts["exact"]) / samples if samples else 0.0,
            "token_agreement": self.agreed_tokens / self.output_tokens if self.output_tokens else 1.0,
            "literal_special_text": {
                "samples": self.literal_samples,
                "exact": self.literal_exact,
                "names": dict(self.literal_names),
                "examples": self.literal_examples,
            },
            "stop_convention": self.stops.to_json() if self.stops is not None else None,
            "mismatches": self.mismatches,
            "bad_rows": self.bad_rows,
            "gate": {"passed": not reasons, "reasons": reasons, "warnings": warnings},
        }


def bad_row_reasons(bad: int, good: int, max_rate: float) -> list[str]:
    """Bad rows count against a threshold: a gate that skipped them would judge a subset."""
    total = bad + good
    rate = bad / total if total else 0.0
    if bad and rate > max_rate:
        return [f"{bad} bad row(s) ({rate:.2%} of {total}) exceed max_bad_row_rate {max_rate:.2%}"]
    return []


def validate_to_report(
    fmt: OutputFormat,
    rows: Callable[[], Iterable[InputRow | BadRow]] | Sequence[InputRow | BadRow],
    *,
    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE,
    max_bad_row_rate: float = DEFAULT_MAX_BAD_ROW_RATE,
    allow_unvalidated_overflow: bool = False,
    on_bad_row: str = "fail",
    workers: int = 1,
) -> dict[str, Any]:
    """Two passes over `rows` (a sequence, or a function that opens the rows afresh): the stop
    convention first, then the classification."""
    open_rows = rows if callable(rows) else (lambda: rows)
    stops = detect_stop_convention(fmt, open_rows())
    summary = ValidationSummary(max_bpe_mismatch_rate, stops, max_bad_row_rate, allow_unvalidated_overflow)
    for item in validate_rows(fmt, open_rows(), stops=stops, on_bad_row=on_bad_row, workers=workers):
        summary.add(item)
    return summary.report()


def validation_rows_table(results: Iterable[RowResult], dataset: str, source: str) -> pa.Table:
    """Per-row results as a `schemas.VALIDATION_ROWS` table (billed_tokens null: local ids)."""
    import pyarrow as pa

    from eagle3_data.schemas import VALIDATION_ROWS

    rs = [r for r in results if isinstance(r, RowResult)]
    return pa.Table.from_pylist(
        [
            {
                "sample_id": r.sample_id,
                "dataset": dataset,
                "source": source,
                "class": r.cls,
                "first_diff": r.first_diff,
                "original": r.original,
                "reconstructed": r.reconstructed,
                "output_tokens": r.output_tokens,
                "billed_tokens": None,
            }
            for r in rs
        ],
        schema=VALIDATION_ROWS,
    )
