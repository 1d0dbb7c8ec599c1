"""Verified resume, `rerun`, and answers without a price (issue 13 items 2-3, issue 10 item 7).

Real SeaweedFS and the dev inference server; its per-sample counters say what was paid.
"""

from __future__ import annotations

import json
import logging

import pytest

from eagle3_data.stages.generate.contracts import StopReason
from eagle3_data.stages.generate.openrouter_pricing import Prices, price_answer
from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, prompts

PRICE = {"prompt": 1e-6, "completion": 1e-5}
REF = StageRef(run_key="verify", stage="generate_overflow", dataset="chat")


def _run(store, server, tok, todo, tmp_path, budget, **kw):
    return generate_overflow(
        store,
        REF,
        todo,
        tok,
        server.url + "/v1",
        SECRET,
        MODEL,
        {},
        budget,
        sampling=SAMPLING,
        concurrency=4,
        rows_per_part=4,
        journal_dir=tmp_path,
        first_cost_estimate_usd=0.001,
        **kw,
    )


def _flip(store, name: str, offset: int) -> None:
    """Change one byte of a committed part in place, size unchanged (bit rot, a bad copy)."""
    key = store.key(REF, name)
    body = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    body[offset] ^= 0xFF
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))


def _paid(server) -> dict[str, int]:
    return server.stats()["answered"].get("chat", {})


@pytest.fixture
def server(start_dev_server):
    return start_dev_server({"price_per_token": PRICE})


@pytest.mark.parametrize("where", ["body", "footer"])
def test_resume_discards_a_corrupt_part_and_replays_it_from_the_journal(
    where, store, server, kimi_tokenizer, tmp_path, caplog
):
    todo = prompts(30, "chat")
    first = _run(store, server, kimi_tokenizer, todo, tmp_path, 0.01)
    assert first["stopped_reason"] == "budget" and first["counts"]["ok"] >= 4, first
    _flip(store, "part-00000.parquet", 40 if where == "body" else -3)  # -3: inside the footer length/magic
    with caplog.at_level(logging.WARNING):
        second = _run(store, server, kimi_tokenizer, todo, tmp_path, None)
    assert second["complete"] and second["counts"]["replayed"] >= 4, second
    assert "part-00000.parquet" in caplog.text and "corrupted" in caplog.text
    store.verify(REF)  # every part matches the manifest
    rows = store.read_table(REF).to_pylist()
    assert sorted(r["sample_id"] for r in rows) == sorted(p["sample_id"] for p in todo)
    assert set(_paid(server).values()) == {1}  # the corrupt part's rows came from the journal, not paid again
    assert store.read_manifest(REF)["extra"]["writer"]["corrupt_parts_discarded"] == 1


def test_corrupt_part_without_journal_is_regenerated_never_committed(store, server, kimi_tokenizer, tmp_path):
    todo = prompts(30, "chat")
    _run(store, server, kimi_tokenizer, todo, tmp_path / "machine-a", 0.01)
    _flip(store, "part-00000.parquet", 40)
    second = _run(store, server, kimi_tokenizer, todo, tmp_path / "machine-b", None)  # no journal here
    assert second["complete"]
    store.verify(REF)
    assert len(store.read_table(REF)) == 30
    assert sorted(v for v in _paid(server).values() if v > 1) == [2] * 4  # exactly the 4 corrupt rows paid again


def test_rerun_of_a_complete_stage_reverifies_and_pays_only_for_what_is_bad(store, server, kimi_tokenizer, tmp_path):
    todo = prompts(12, "chat")
    assert _run(store, server, kimi_tokenizer, todo, tmp_path, None)["complete"]
    assert _run(store, server, kimi_tokenizer, todo, tmp_path, None)["reused"]
    _flip(store, "part-00001.parquet", 40)
    with pytest.raises(Exception, match="part-00001.parquet is corrupted"):
        store.verify(REF)
    again = _run(store, server, kimi_tokenizer, todo, tmp_path, None, rerun=True)
    assert again["complete"] and not again.get("reused"), again
    store.verify(REF)
    paid = _paid(server)
    assert len(paid) == 12 and sorted(paid.values()).count(2) == 4  # part-00001's 4 rows, nothing else


def test_price_answer_uses_cost_then_configured_prices():
    assert price_answer({"cost": 0.5, "prompt_tokens": 10, "completion_tokens": 10}, Prices()) == 0.5
    per_mtok = Prices.per_mtok({"prompt": 1.0, "completion": 3.0})
    assert price_answer({"prompt_tokens": 1_000_000, "completion_tokens": 2_000_000}, per_mtok) == pytest.approx(7.0)
    assert (
        price_answer(
            {"prompt_tokens": 10, "completion_tokens": 10}, Prices.per_mtok({"prompt": 0.0, "completion": 0.0})
        )
        is None
    )
    assert price_answer({"completion_tokens": 10}, Prices.per_mtok({"prompt": 1.0, "completion": 1.0})) is None


# OpenRouter's record of each generation never appears (GET /generation?id= answers 404 throughout)
NO_RECORD = {"omit_cost": 1.0, "generation_lag": 10_000}


def test_answers_without_cost_are_priced_from_openrouters_generation_record(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    """No usage.cost and no configured price: the cost comes from GET /generation?id=, asked again
    while it answers 404 (its record lags the completion), and the budget binds on it."""
    server = start_dev_server(
        {"price_per_token": PRICE, "endpoints": {"chat": {"omit_cost": 1.0, "generation_lag": 2}}}
    )
    todo = prompts(40, "chat")
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, 0.01, cost_lookup_delay_s=0.01)
    assert s["stopped_reason"] == "budget" and 0 < s["cost_usd"] <= 0.01, s
    rows = _committed_rows(store)
    assert rows and all(json.loads(r["provenance"])["cost_source"] == "generation_lookup" for r in rows)
    for r in rows:  # the dev server's price of exactly these tokens
        u = r["usage"]
        assert u["cost_usd"] == pytest.approx(
            u["prompt_tokens"] * PRICE["prompt"] + u["completion_tokens"] * PRICE["completion"]
        )


def _committed_rows(store) -> list[dict]:
    import pyarrow.parquet as pq

    out = []
    for record in store.progress_records(REF):
        with store.open_verified(REF, record["name"], sha256=record["sha256"], nbytes=record["bytes"]) as f:
            out += pq.read_table(f).to_pylist()
    return out


def test_answers_without_cost_stop_a_budgeted_stage(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": NO_RECORD}})
    todo = prompts(40, "chat")
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, 5.0, cost_lookup_delay_s=0.01)
    assert s["stopped_reason"] == StopReason.UNPRICED and not s["complete"], s
    assert sum(_paid(server).values()) <= 8  # dispatch stopped at the first unpriced answers (4 in flight)
    assert len(store.committed_sample_ids(REF)) == sum(_paid(server).values())  # what was paid is kept


def test_answers_without_cost_are_priced_from_configured_prices(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": NO_RECORD}})
    todo = prompts(40, "chat")
    mtok = {"prompt": PRICE["prompt"] * 1e6, "completion": PRICE["completion"] * 1e6}
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, 0.01, price_usd_per_mtok=mtok, cost_lookup_delay_s=0.01)
    assert s["stopped_reason"] == "budget" and 0 < s["cost_usd"] <= 0.01, s  # max_usd binds
    rows = store.read_table(REF).to_pylist() if store.is_complete(REF) else None
    assert rows is None
    assert len(_paid(server)) < 40
