"""Which samples go local (SGLang) and which overflow (OpenRouter), and whether the two agree.

Routes are a pure function of the sample_ids and the routing numbers: samples are ranked by a hash
of their sample_id, so a sample keeps its route whatever the file order and the counts are exact.
A calibration overlap of K samples goes both ways (route "both") at temperature 0; comparing the
engine's ids with the reconstruction of the provider's text over the first N tokens tells whether
the provider plausibly serves the same model and template. docs/generation.md says what that
comparison can and cannot prove.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eagle3_data.errors import UserError

if TYPE_CHECKING:
    from eagle3_data.balance import Rates
    from eagle3_data.config import RoutingConfig


def local_capacity(tokens_per_s: float, time_budget_s: float, expected_tokens_per_sample: float) -> int:
    """Samples the local endpoints finish in the time budget (aggregate throughput x time / tokens)."""
    if tokens_per_s < 0 or time_budget_s < 0 or expected_tokens_per_sample <= 0:
        raise UserError("routing capacity: tokens_per_s and time_budget_s must be >= 0, expected tokens > 0")
    return math.floor(tokens_per_s * time_budget_s / expected_tokens_per_sample)


def assign_routes(sample_ids: Sequence[str], routing: RoutingConfig, rates: Rates | None = None) -> list[str]:
    """The route of each sample ("local" | "overflow" | "both"), in the order of `sample_ids`.

    Only the ids are needed (not the rows): the prompts stage spills its rows and routes from
    the ids alone, so routing costs no memory per prompt beyond its id.

    fraction: round(n * overflow_fraction) samples overflow; capacity: `local_capacity` stay local;
    balanced: the local count that makes both sides, running at once, finish together at `rates`
    (balance.side_rates: endpoints, in-flight, concurrency and observed latencies; required).
    The first `calibration_samples` local-ranked samples get route "both" (they count as local).
    """
    from eagle3_data.balance import STRATEGIES, balanced_local_count

    strategy, overflow_fraction = routing.strategy, routing.overflow_fraction
    if strategy not in STRATEGIES:
        raise UserError(f"routing strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not 0.0 <= overflow_fraction <= 1.0:
        raise UserError(f"routing overflow_fraction {overflow_fraction}: expected a value in [0, 1]")
    ranked = sorted(sample_ids, key=lambda sid: hashlib.sha256(sid.encode()).digest())
    n = len(ranked)
    n_local = n - round(n * overflow_fraction) if strategy == "fraction" else min(n, max(0, routing.local_capacity))
    if strategy == "balanced":
        if rates is None:
            raise ValueError("assign_routes: the balanced strategy needs the sides' rates")
        n_local = balanced_local_count(n, routing.calibration_samples, rates)
    n_both = min(max(0, routing.calibration_samples), n_local)
    route = {sid: ("both" if i < n_both else "local") if i < n_local else "overflow" for i, sid in enumerate(ranked)}
    return [route[sid] for sid in sample_ids]
