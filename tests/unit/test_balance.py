"""Finish-together routing (balance.py): the balanced split makes local and overflow,
running at once, finish within one sample's time of each other, for any rates and sizes."""

from __future__ import annotations

import math
import random

import pytest

from eagle3_data.balance import (
    Rates,
    balanced_local_count,
    compare_strategies,
    side_rates,
    split,
)


def test_littles_law_rates():
    r = side_rates(
        local_endpoints=8,
        in_flight_per_endpoint=64,
        local_latency_s=128.0,
        overflow_concurrency=256,
        overflow_latency_s=6.4,
    )
    assert (r.local, r.overflow) == (4.0, 40.0)


@pytest.mark.parametrize("seed", range(20))
def test_balanced_sides_finish_within_one_sample_of_each_other(seed):
    rng = random.Random(seed)
    rates = Rates(local=rng.uniform(0.05, 50), overflow=rng.uniform(0.05, 50))
    n, calibration = rng.randint(1, 100_000), rng.randint(0, 50)
    k = balanced_local_count(n, calibration, rates)
    s = split(n, k, calibration, rates)
    assert abs(s.local_s - s.overflow_s) <= max(1 / rates.local, 1 / rates.overflow) + 1e-9
    # no other split finishes sooner
    assert all(split(n, j, calibration, rates).wall_s >= s.wall_s - 1e-9 for j in (k - 1, k + 1) if 0 <= j <= n)


def test_balanced_beats_a_fixed_fraction_in_time_and_the_all_overflow_in_cost():
    """The issue's example: 8 endpoints; a fraction that leaves the local side idle takes longer,
    sending everything to the provider costs more."""
    rates = side_rates(
        local_endpoints=8,
        in_flight_per_endpoint=64,
        local_latency_s=60.0,
        overflow_concurrency=256,
        overflow_latency_s=6.0,
    )
    plans = compare_strategies(
        83_000, overflow_fraction=0.25, local_capacity=0, calibration=0, rates=rates, usd_per_overflow_sample=0.01
    )
    assert set(plans) == {"fraction", "capacity", "balanced"}
    bal, frac, cap = plans["balanced"], plans["fraction"], plans["capacity"]
    assert bal["wall_s"] < frac["wall_s"] and bal["wall_s"] < cap["wall_s"]
    assert bal["overflow_usd"] < cap["overflow_usd"]  # capacity 0: all overflow
    assert bal["local"] + bal["overflow"] == 83_000
    assert math.isclose(bal["local"] / 83_000, rates.local / (rates.local + rates.overflow), abs_tol=1e-4)


def test_a_side_without_capacity_takes_nothing():
    assert balanced_local_count(10, 0, Rates(local=0.0, overflow=1.0)) == 0
    assert balanced_local_count(10, 2, Rates(local=1.0, overflow=0.0)) == 10
    assert split(10, 10, 0, Rates(local=0.0, overflow=1.0)).as_dict()["wall_s"] is None  # never: JSON null
    assert balanced_local_count(0, 3, Rates(1.0, 1.0)) == 0


def test_calibration_samples_count_on_both_sides():
    rates = Rates(local=1.0, overflow=1.0)
    k = balanced_local_count(10, 4, rates)  # (10 + 4) / 2 = 7 local, 3 + 4 overflow
    s = split(10, k, 4, rates)
    assert (s.local, s.overflow) == (7, 7) and s.local_s == s.overflow_s
