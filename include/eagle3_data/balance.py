"""Finish-together routing: how many samples to keep local so that the local engines and the
overflow provider, running at the same time, finish at the same time.

A fixed fraction or capacity leaves one side idle while the other still works: the run takes as
long as its slower side. With the local rate r_l (samples/s: endpoints x in-flight per endpoint /
observed seconds per local sample at that in-flight) and the overflow rate r_o (concurrency /
observed seconds per overflow request, Little's law), a run of n samples of which b are
calibration samples generated on both sides finishes together when

    n_local / r_l = (n - n_local + b) / r_o   =>   n_local = (n + b) * r_l / (r_l + r_o)

rounded to the integer that gives the shorter wall time: the two sides then finish within one
sample's time of each other. Every strategy's local count, wall time and overflow cost come from
the same functions, so the dry-run plan compares them on equal terms.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

STRATEGIES = ("fraction", "capacity", "balanced")


@dataclass(frozen=True)
class Rates:
    """Samples per second each side sustains."""

    local: float
    overflow: float


def side_rates(
    *,
    local_endpoints: int,
    in_flight_per_endpoint: int,
    local_latency_s: float,
    overflow_concurrency: int,
    overflow_latency_s: float,
) -> Rates:
    """Little's law on each side: requests in flight / seconds per request."""
    local = local_endpoints * in_flight_per_endpoint / local_latency_s if local_latency_s > 0 else 0.0
    overflow = overflow_concurrency / overflow_latency_s if overflow_latency_s > 0 else 0.0
    return Rates(local=local, overflow=overflow)


@dataclass(frozen=True)
class Split:
    """One strategy's outcome for n samples: counts per side (calibration samples on both),
    each side's finish time with both running at once, the wall time, and the overflow spend."""

    local: int
    overflow: int
    local_s: float
    overflow_s: float
    wall_s: float
    overflow_usd: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: a side that can never finish (rate 0 with samples routed to it) is None."""
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(self).items()}


def split(n: int, n_local: int, calibration: int, rates: Rates, usd_per_overflow_sample: float = 0.0) -> Split:
    """The outcome of keeping `n_local` of `n` samples local (the first `calibration` of them
    also go to overflow, as routing's "both")."""
    n_local = max(0, min(n, n_local))
    n_over = n - n_local + min(max(0, calibration), n_local)
    local_s = _seconds(n_local, rates.local)
    overflow_s = _seconds(n_over, rates.overflow)
    return Split(
        local=n_local,
        overflow=n_over,
        local_s=local_s,
        overflow_s=overflow_s,
        wall_s=max(local_s, overflow_s),
        overflow_usd=n_over * usd_per_overflow_sample,
    )


def _seconds(count: int, rate: float) -> float:
    if count == 0:
        return 0.0
    return count / rate if rate > 0 else math.inf


def balanced_local_count(n: int, calibration: int, rates: Rates) -> int:
    """Samples to keep local so both sides finish together (the shorter wall time of the two
    integers around the exact split; a tie keeps the extra sample local: it costs nothing)."""
    if n <= 0:
        return 0
    if rates.overflow <= 0:
        return n
    if rates.local <= 0:
        return 0
    exact = (n + max(0, calibration)) * rates.local / (rates.local + rates.overflow)
    candidates = {max(0, min(n, c)) for c in (math.floor(exact), math.ceil(exact))}
    return min(candidates, key=lambda k: (split(n, k, calibration, rates).wall_s, -k))


def local_count(
    strategy: str, n: int, *, overflow_fraction: float, local_capacity: int, calibration: int, rates: Rates
) -> int:
    """The local sample count each routing strategy gives (routing.assign_routes' rule for
    fraction and capacity)."""
    if strategy == "fraction":
        return n - round(n * overflow_fraction)
    if strategy == "capacity":
        return min(n, max(0, local_capacity))
    return balanced_local_count(n, calibration, rates)


def compare_strategies(
    n: int,
    *,
    overflow_fraction: float,
    local_capacity: int,
    calibration: int,
    rates: Rates,
    usd_per_overflow_sample: float,
) -> dict[str, dict[str, Any]]:
    """Every strategy's split of the same n samples (what the dry-run plan prints)."""
    return {
        s: split(
            n,
            local_count(
                s,
                n,
                overflow_fraction=overflow_fraction,
                local_capacity=local_capacity,
                calibration=calibration,
                rates=rates,
            ),
            calibration,
            rates,
            usd_per_overflow_sample,
        ).as_dict()
        for s in STRATEGIES
    }


def run_totals(per_dataset: list[dict[str, dict[str, Any]]], rates: Rates | None = None) -> dict[str, dict[str, Any]]:
    """Every strategy over a whole run: the datasets share the same endpoints and provider, so
    each side's counts add up and its finish time is the sum of the datasets' times on it (each
    at its own rate: a dataset's rates may come from its previous run), or the total count over
    `rates` when given (`compare_strategies` results of each dataset in, the same shape out)."""
    out: dict[str, dict[str, Any]] = {}
    for name in STRATEGIES:
        plans = [d[name] for d in per_dataset if name in d]
        local, overflow = sum(p["local"] for p in plans), sum(p["overflow"] for p in plans)
        if rates is not None:
            local_s, overflow_s = _seconds(local, rates.local), _seconds(overflow, rates.overflow)
        else:
            local_s, overflow_s = (
                sum(math.inf if p[k] is None else p[k] for p in plans) for k in ("local_s", "overflow_s")
            )
        out[name] = Split(
            local=local,
            overflow=overflow,
            local_s=local_s,
            overflow_s=overflow_s,
            wall_s=max(local_s, overflow_s),
            overflow_usd=round(sum(p["overflow_usd"] for p in plans), 6),
        ).as_dict()
    return out
