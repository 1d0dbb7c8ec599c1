"""The multi-process overflow prototype (generation/overflow_pool.py) writes the same stage as
the one-loop client, honours the budget across processes, and stops on 402 like it."""

from __future__ import annotations

import pytest

from eagle3_data.generation.openrouter import generate_overflow
from eagle3_data.generation.overflow_pool import generate_overflow_pool
from eagle3_data.storage import StageRef
from tests.integration.test_generation import SAMPLING, SECRET, prompts

ROWS = ["sample_id", "status", "reasoning", "content", "tool_calls", "finish_reason", "prompt_ids"]


def test_pool_writes_what_one_loop_writes(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({})
    one = StageRef("run-p", "generate_overflow", "one")
    pool = StageRef("run-p", "generate_overflow", "pool")
    args = (kimi_tokenizer, server.url + "/v1", SECRET, "moonshotai/kimi-k2.5", {"order": ["moonshotai"]}, 5.0)
    a = generate_overflow(store, one, prompts(20), *args, sampling=SAMPLING, concurrency=6, journal_dir=tmp_path / "a")
    b = generate_overflow_pool(store, pool, prompts(20), *args, processes=2, sampling=SAMPLING, concurrency=6,
                               rows_per_part=7, journal_dir=tmp_path / "b")
    assert b["complete"] and b["counts"] == a["counts"] and b["counts"]["ok"] == 20, b
    assert b["cost_usd"] == pytest.approx(a["cost_usd"], abs=1e-5)  # summed in another order, rounded
    key = lambda r: r["sample_id"]  # noqa: E731
    assert sorted(store.read_table(pool, columns=ROWS).to_pylist(), key=key) == \
        sorted(store.read_table(one, columns=ROWS).to_pylist(), key=key)
    assert store.read_manifest(pool)["params"] == store.read_manifest(one)["params"]  # interchangeable stages
    assert all(server.stats()["answered"]["chat"][f"s{i:04d}"] == 2 for i in range(20))  # once per client


def test_pool_budget_and_402_stop_dispatch(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({})
    ref = StageRef("run-q", "generate_overflow", "budget")
    args = (kimi_tokenizer, server.url + "/v1", SECRET, "m", {})
    s = generate_overflow_pool(store, ref, prompts(24), *args, 1e-9, processes=2, sampling=SAMPLING, concurrency=8,
                               journal_dir=tmp_path, first_cost_estimate_usd=1e-10)
    assert s["stopped_reason"] == "budget" and not s["complete"]
    assert 0 < s["counts"]["ok"] < 24  # dispatch stopped once the cap was spent
    server = start_dev_server({"endpoints": {"chat": {"credits_after": 3}}})
    ref = StageRef("run-q", "generate_overflow", "credits")
    s = generate_overflow_pool(store, ref, prompts(10), *args, 5.0, processes=2, sampling=SAMPLING, concurrency=4,
                               journal_dir=tmp_path)
    assert s["stopped_reason"] == "credits" and 3 <= s["counts"]["ok"] < 10
