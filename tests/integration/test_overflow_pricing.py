"""Every generation that ran is priced (issue 55): the stage's spend against the dev server's
ledger (`dev/stats` `billed_usd`: the sum of its GET /v1/generation records), never our pricing.

A stream that fails mid-generation with OpenRouter's `error` data event and no usage was billed
for its prompt and the tokens it sent: it is priced from its generation's record before the
retry, as a cut stream is. A record that is not there yet after the client's lookups is counted
at the budget's estimate (an upper bound) and looked up again before the manifest is written
(`record_wait_s`), so the spend equals the ledger when the records come within the stage, and is
never below it when they do not.
"""

from __future__ import annotations

import pytest

from tests.integration.test_generation import prompts
from tests.integration.test_overflow_streaming import PRICE, _lost, _run


def _priced(store, ref) -> dict:
    return store.read_manifest(ref)["extra"]


def test_an_errored_stream_is_priced_from_its_generation_record(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"seed": 5, "price_per_token": PRICE, "endpoints": {"chat": {"stream_error": 0.4}}})
    ref, s = _run(store, server, kimi_tokenizer, prompts(24, "chat"), tmp_path, "errored", cost_lookup_delay_s=0.01)
    stats = server.stats()
    assert s["complete"] and s["counts"]["ok"] == 24, s
    errored = stats["faults"]["chat"]["stream_error"]
    assert errored >= 5, stats
    lost = [a for r in store.read_table(ref).to_pylist() for a in _lost(r)]
    assert len(lost) == s["counts"]["lost_attempts"] == errored
    assert {a["cost_source"] for a in lost} == {"generation_lookup"} and all(a["cost_usd"] > 0 for a in lost)
    print("errored streams", errored, "spent", s["cost_usd"], "ledger", stats["billed_usd"])
    assert s["cost_usd"] == pytest.approx(stats["billed_usd"], rel=1e-6)
    extra = _priced(store, ref)
    assert extra["spent_total_usd"] == pytest.approx(stats["billed_usd"], abs=1e-6)
    assert extra["lost_attempts_priced"] == {"by_record": errored, "by_estimate": 0, "repriced": []}


def test_a_late_record_replaces_the_estimate_before_the_manifest(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Errored and cut streams whose records appear 1 s after the generation, one lookup each
    (404): counted at the estimate. With no wait at the end they stay there, above the ledger;
    with a wait, every one is priced by its record and the spend is the ledger's."""
    config = {
        "seed": 5,
        "price_per_token": PRICE,
        "endpoints": {"chat": {"stream_error": 0.3, "stream_cut": 0.2, "record_delay_s": 1.0}},
    }
    figures = {}
    for wait in (0.0, 30.0):
        server = start_dev_server(config)  # a fresh ledger
        name = f"late-{int(wait)}"
        ref, s = _run(
            store, server, kimi_tokenizer, prompts(16, "chat"), tmp_path, name, cost_lookups=1, record_wait_s=wait
        )
        stats = server.stats()
        assert s["complete"] and s["counts"]["ok"] == 16, s
        faults = stats["faults"]["chat"]
        n = faults["stream_error"] + faults["stream_cut"]
        assert faults["stream_error"] >= 2 and faults["stream_cut"] >= 2 and s["counts"]["lost_attempts"] == n, faults
        priced = _priced(store, ref)["lost_attempts_priced"]
        figures[wait] = (n, s["cost_usd"], stats["billed_usd"], priced["by_record"], priced["by_estimate"])
        if wait == 0:  # never below what the records say
            assert priced["by_record"] == 0 and priced["by_estimate"] == n, priced
            assert s["cost_usd"] > stats["billed_usd"]
        else:
            assert priced["by_record"] == n and priced["by_estimate"] == 0, priced
            assert len(priced["repriced"]) == n and all(
                r["cost_usd"] <= r["estimate_usd"] for r in priced["repriced"]
            ), priced
            assert s["cost_usd"] == pytest.approx(stats["billed_usd"], rel=1e-6)
            assert _priced(store, ref)["spent_total_usd"] == pytest.approx(stats["billed_usd"], abs=1e-6)
    print("late records (lost, spent, ledger, by_record, by_estimate)", figures)
