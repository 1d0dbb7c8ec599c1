"""Every OpenRouter response shape, as the service sends it (dev server faults), handled as it means.

Each test fails on a client that reads the shape the naive way: a 200 carrying an error read as an
unpriced answer, a 403 key limit turned into permanent rows, a 402 in-flight budget taken for
empty credits, reasoning only in `reasoning_details` lost, object arguments failing the row, a paid
but unusable answer paid again on every rerun, an answer from another model or provider kept.
"""

from __future__ import annotations

import json

import pytest

from eagle3_data.schemas import IDENTITY_MISMATCH
from eagle3_data.stages.generate.contracts import StopReason
from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, prompts

PRICE = {"prompt": 1e-6, "completion": 1e-5}
PIN = {"order": ["moonshotai"], "allow_fallbacks": False}


def _run(store, server, tok, todo, tmp_path, ref, budget=None, provider=None, **kw):
    kw.setdefault("concurrency", 4)
    kw.setdefault("rows_per_part", 4)
    return generate_overflow(
        store,
        ref,
        todo,
        tok,
        server.url + "/v1",
        SECRET,
        kw.pop("model", MODEL),
        PIN if provider is None else provider,
        budget,
        sampling=SAMPLING,
        journal_dir=tmp_path,
        first_cost_estimate_usd=0.001,
        **kw,
    )


def _ref(name: str) -> StageRef:
    return StageRef(run_key="shapes", stage="generate_overflow", dataset=name)


def _answered(server) -> dict[str, int]:
    return server.stats()["answered"].get("chat", {})


def _rows(store, ref) -> dict[str, dict]:
    import pyarrow.parquet as pq

    if store.is_complete(ref):
        return {r["sample_id"]: r for r in store.read_table(ref).to_pylist()}
    out = {}
    for record in store.progress_records(ref):
        with store.open_verified(ref, record["name"], sha256=record["sha256"], nbytes=record["bytes"]) as f:
            out.update({r["sample_id"]: r for r in pq.read_table(f).to_pylist()})
    return out


def test_200_with_an_error_is_retried_and_names_the_providers_message(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server({"seed": 1, "price_per_token": PRICE, "endpoints": {"chat": {"error_in_body": 0.4}}})
    ref = _ref("body-error")
    s = _run(store, server, kimi_tokenizer, prompts(24, "chat"), tmp_path, ref, budget=5.0)
    assert s["complete"] and s["counts"]["ok"] == 24, s  # retried, not "unpriced_answer"
    assert server.stats()["faults"]["chat"]["error_in_body"] >= 5
    assert set(_answered(server).values()) == {1}  # an error body is not billed, the retry is the one answer
    # every attempt an error: the row fails (not final) with the provider's code, name and message
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"error_in_body": 1.0}}})
    ref = _ref("body-error-always")
    s = _run(store, server, kimi_tokenizer, prompts(3, "chat"), tmp_path, ref, budget=5.0, max_attempts=2)
    assert s["stopped_reason"] == "retryable_failures" and s["counts"]["retry_later"] == 3, s
    errors = {f["error"] for f in store.get_json(ref, "failures.json").values()}
    assert errors == {
        "gave up after 2 attempts: provider error 502 (Moonshot AI): Provider returned error "
        "[upstream connection reset (injected)]"
    }, errors


def test_paid_answers_that_fail_are_final_and_never_paid_again(store, start_dev_server, kimi_tokenizer, tmp_path):
    """The measured bug: answers that are paid but unusable (empty, cut by a provider error
    mid-generation) were neither journaled nor counted, so each budget-stopped rerun paid for the
    same samples again (24 -> 48 -> 72 answers for 24 samples)."""
    server = start_dev_server(
        {"seed": 2, "price_per_token": PRICE, "endpoints": {"chat": {"empty_content": 0.5, "choice_error": 0.3}}}
    )
    ref, todo = _ref("paid-failures"), prompts(24, "chat")
    spent = []
    for budget in (0.004, 0.008, 5.0):
        s = _run(store, server, kimi_tokenizer, todo, tmp_path, ref, budget=budget)
        spent.append(s["cost_usd"])
        if s["complete"]:
            break
    assert s["complete"], s
    answered = _answered(server)
    assert set(answered.values()) == {1} and len(answered) == 24, answered  # each sample paid exactly once
    rows = _rows(store, ref)
    failed = [r for r in rows.values() if r["status"] != "ok"]
    assert failed and all(r["usage"]["cost_usd"] > 0 for r in failed)  # paid, committed with their cost
    assert {r["error"].split(":")[0] for r in failed} <= {"empty answer", "provider error 502 (Moonshot AI)"}
    assert any("mid-generation" in r["error"] for r in failed)
    assert sum(r["usage"]["cost_usd"] for r in rows.values()) == pytest.approx(sum(spent))


def test_402_in_flight_budget_pauses_and_retries(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server(
        {"seed": 3, "price_per_token": PRICE, "endpoints": {"chat": {"in_flight_402": 0.3, "retry_after_s": 0.05}}}
    )
    ref = _ref("in-flight")
    s = _run(store, server, kimi_tokenizer, prompts(20, "chat"), tmp_path, ref, budget=5.0)
    assert s["complete"] and s["counts"]["ok"] == 20, s  # not stopped as "credits"
    assert server.stats()["faults"]["chat"]["in_flight_402"] >= 3
    # it never passes within the attempts: a stop that passes by itself, the samples left pending
    server = start_dev_server(
        {"price_per_token": PRICE, "endpoints": {"chat": {"in_flight_402": 1.0, "retry_after_s": 0.05}}}
    )
    ref = _ref("in-flight-always")
    s = _run(store, server, kimi_tokenizer, prompts(6, "chat"), tmp_path, ref, budget=5.0, max_attempts=2)
    assert s["stopped_reason"] == StopReason.IN_FLIGHT_BUDGET and "in-flight requests" in s["stop_detail"], s
    assert s["counts"]["failed"] == s["counts"]["retry_later"] == 0 and store.get_json(ref, "failures.json") == {}


def test_403_key_limit_stops_dispatch_and_a_rerun_after_the_limit_generates_the_rest(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"forbidden_after": 6}}})
    ref, todo = _ref("key-limit"), prompts(30, "chat")
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, ref, budget=5.0)
    assert s["stopped_reason"] == "forbidden" and "Key limit exceeded" in s["stop_detail"], s
    assert s["counts"]["failed"] == 0 and store.get_json(ref, "failures.json") == {}  # no sample lost
    assert sum(server.stats()["faults"]["chat"].values()) <= 4  # dispatch stopped at the first 403s
    server = start_dev_server({"price_per_token": PRICE})  # the limit is lifted
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, ref, budget=5.0)
    assert s["complete"] and len(_rows(store, ref)) == 30 and s["counts"]["ok"] == 24, s


def test_403_moderation_fails_that_prompt_only(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"seed": 4, "price_per_token": PRICE, "endpoints": {"chat": {"moderation": 0.2}}})
    ref = _ref("moderation")
    s = _run(store, server, kimi_tokenizer, prompts(30, "chat"), tmp_path, ref, budget=5.0)
    assert s["complete"], s
    flagged = [r for r in _rows(store, ref).values() if r["status"] == "failed"]
    assert flagged and all(
        r["error"].startswith("HTTP 403 (Moonshot AI): moonshotai/kimi-k2.5 requires moderation") for r in flagged
    )
    assert all(server.stats()["requests"]["chat"][r["sample_id"]] == 1 for r in flagged)  # never retried


def test_identical_permanent_errors_trip_the_circuit_breaker(store, start_dev_server, kimi_tokenizer, tmp_path):
    """A 400 for every request (a parameter the provider refuses) stops dispatch with that error
    after K in a row; the K samples stay pending, so the rerun after the fix generates them."""
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"bad_request": 1.0}}})
    ref, todo = _ref("breaker"), prompts(60, "chat")
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, ref, budget=5.0, max_identical_errors=5)
    assert (
        s["stopped_reason"] == StopReason.REPEATED_ERROR
        and "HTTP 400: Provider rejected the request" in s["stop_detail"]
    ), s
    assert sum(server.stats()["requests"]["chat"].values()) <= 5 + 4  # K, and the ones in flight
    assert s["counts"]["failed"] == 0 and store.get_json(ref, "failures.json") == {}
    server = start_dev_server({"price_per_token": PRICE})
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, ref, budget=5.0, max_identical_errors=5)
    assert s["complete"] and s["counts"]["ok"] == 60, s


def test_reasoning_only_in_reasoning_details_is_read_in_index_order(store, start_dev_server, kimi_tokenizer, tmp_path):
    todo = prompts(12, "chat")
    server = start_dev_server({"seed": 5, "price_per_token": PRICE})
    plain = _ref("reasoning-plain")
    assert _run(store, server, kimi_tokenizer, todo, tmp_path, plain, budget=5.0)["complete"]
    server = start_dev_server(
        {"seed": 5, "price_per_token": PRICE, "endpoints": {"chat": {"reasoning_details_only": 1.0}}}
    )
    detailed = _ref("reasoning-details")
    s = _run(store, server, kimi_tokenizer, todo, tmp_path, detailed, budget=5.0)
    assert s["complete"] and s["counts"]["ok"] == 12, s  # not "reasoning billed but absent"
    a, b = _rows(store, plain), _rows(store, detailed)
    assert any(r["reasoning"] for r in a.values())
    assert {k: r["reasoning"] for k, r in a.items()} == {k: r["reasoning"] for k, r in b.items()}


def test_encrypted_reasoning_is_unreconstructable_and_final(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"encrypted_reasoning": 1.0}}})
    ref = _ref("encrypted")
    s = _run(store, server, kimi_tokenizer, prompts(8, "chat"), tmp_path, ref, budget=5.0)
    assert s["complete"], s
    rows = [r for r in _rows(store, ref).values() if r["status"] != "ok"]
    assert rows and all(r["status"] == "unreconstructable" and "reasoning.encrypted" in r["error"] for r in rows)
    assert set(_answered(server).values()) == {1}


def test_object_arguments_are_serialised_and_marked(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"object_arguments": 1.0}}})
    ref = _ref("object-args")
    s = _run(store, server, kimi_tokenizer, prompts(12), tmp_path, ref, budget=5.0)
    assert s["complete"] and s["counts"]["ok"] == 12, s  # not "malformed tool call", paid again next run
    called = [r for r in _rows(store, ref).values() if r["tool_calls"]]
    assert called
    for r in called:
        for c in json.loads(r["tool_calls"]):
            assert isinstance(c["function"]["arguments"], str) and isinstance(
                json.loads(c["function"]["arguments"]), dict
            )
        assert json.loads(r["provenance"])["rewritten"] == ["tool_call_arguments_serialised"]


def test_answers_from_another_model_or_provider_fail_as_identity_mismatch(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server(
        {"seed": 6, "price_per_token": PRICE, "endpoints": {"chat": {"wrong_model": 0.15, "wrong_provider": 0.15}}}
    )
    ref = _ref("identity")
    s = _run(store, server, kimi_tokenizer, prompts(40, "chat"), tmp_path, ref, budget=5.0)
    assert s["complete"], s
    rows = _rows(store, ref).values()
    bad = [r for r in rows if r["status"] == IDENTITY_MISMATCH]
    reasons = {r["error"].split(":")[1].strip() for r in bad}
    assert reasons == {"model", "provider"}, [r["error"] for r in bad]
    assert all(json.loads(r["provenance"])["provider"] == "Moonshot AI" for r in rows if r["status"] == "ok")
    assert any("'Chutes' (slug chutes), pinned moonshotai" in r["error"] for r in bad)
    assert set(_answered(server).values()) == {1}  # paid: final, not asked again


def test_identity_pins_are_checked_before_the_first_request(store, start_dev_server, kimi_tokenizer, tmp_path):
    from eagle3_data.errors import UserError

    server = start_dev_server({"price_per_token": PRICE})
    with pytest.raises(UserError, match="'moonshotai/kimi-k2' is not a model .* lists at GET /models"):
        _run(store, server, kimi_tokenizer, prompts(4, "chat"), tmp_path, _ref("bad-pin"), model="moonshotai/kimi-k2")
    assert server.stats()["requests"].get("chat") is None  # nothing sent
    # the answers' dated canonical slug is the same model; no provider pin: any provider
    server = start_dev_server(
        {
            "price_per_token": PRICE,
            "canonical_slug": "moonshotai/kimi-k2.5-0127",
            "answer_canonical_slug": True,
            "provider": "Chutes",
        }
    )
    s = _run(store, server, kimi_tokenizer, prompts(4, "chat"), tmp_path, _ref("any-provider"), provider={})
    assert s["complete"] and s["counts"]["ok"] == 4, s
    assert {json.loads(r["provenance"])["model"] for r in _rows(store, _ref("any-provider")).values()} == {
        "moonshotai/kimi-k2.5-0127"
    }
