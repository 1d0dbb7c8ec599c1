"""Who generated the rows: answers whose model or provider is not the pin, counted and gated.

The overflow client marks each such answer `identity_mismatch` (stages/generate/provider_identity.py)
and the local client each answer from an engine serving another model; this is the dataset's
count of them. They are never merged, but a dataset with any (above
`validation.max_identity_mismatch_rate`, default 0) fails its gate: the rest of its overflow
share came through the same routing, and nothing else in the data would show it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from eagle3_data.gate_defaults import DEFAULT_MAX_IDENTITY_MISMATCH_RATE
from eagle3_data.schemas import IDENTITY_MISMATCH
from eagle3_data.stages.validate.gate import EXAMPLES


def identity_report(
    rows: Iterable[dict[str, Any]], *, max_rate: float = DEFAULT_MAX_IDENTITY_MISMATCH_RATE
) -> dict[str, Any]:
    """Over rows with `status`, `error`, `provenance` (JSON) and `sample_id`: answers per
    (model, provider) named, mismatches by reason, and the decision. Unanswered rows (failed
    before any answer: no provenance) do not count."""
    answered, mismatched = 0, 0
    served: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    examples: list[str] = []
    for r in rows:
        if not r.get("provenance"):
            continue
        answered += 1
        prov = json.loads(r["provenance"])
        served[
            f"{prov.get('model') or prov.get('served_model') or '?'} @ {prov.get('provider') or r.get('source') or '?'}"
        ] += 1
        if r.get("status") == IDENTITY_MISMATCH:
            mismatched += 1
            reasons[str(r.get("error") or "")] += 1
            if len(examples) < EXAMPLES:
                examples.append(r["sample_id"])
    rate = mismatched / answered if answered else 0.0
    failing = []
    if mismatched and rate > max_rate:
        top = "; ".join(f"{n}x {why}" for why, n in reasons.most_common(2))
        failing.append(
            f"{mismatched} of {answered} answers ({rate:.2%}) not from the pinned model/provider, above "
            f"max_identity_mismatch_rate {max_rate:.2%} ({top})"
        )
    return {
        "answered": answered,
        "mismatched": mismatched,
        "rate": rate,
        "served": dict(served.most_common()),
        "reasons": dict(reasons.most_common()),
        "examples": examples,
        "gate": {"passed": not failing, "reasons": failing, "max_identity_mismatch_rate": max_rate},
    }
