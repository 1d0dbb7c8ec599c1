"""The overflow client at production length, against the dev server streaming as OpenRouter does.

Every dollar the provider bills is counted: a stream cut by the network or silent past the idle
timeout was still billed whole (the dev server, like a provider that does not cancel on
disconnect, records the generation), so the stage prices it from OpenRouter's record before it
asks again, and the stage's cost equals what the server billed. Keep-alive comments keep a slow
stream alive: the timeout is on silence, not on length. The history goes back in OpenRouter's
documented fields, so a provider that reads only those renders the prompt we train on.
"""

from __future__ import annotations

import json

import pytest

from eagle3_data.stages.generate.contracts import StopReason
from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, WEATHER, prompts

PRICE = {"prompt": 1e-6, "completion": 1e-5}


def _run(store, server, tok, todo, tmp_path, name, budget=5.0, **kw):
    kw.setdefault("concurrency", 4)
    kw.setdefault("rows_per_part", 8)
    kw.setdefault("first_cost_estimate_usd", 0.001)
    ref = StageRef(run_key="streaming", stage="generate_overflow", dataset=name)
    return ref, generate_overflow(
        store,
        ref,
        todo,
        tok,
        server.url + "/v1",
        SECRET,
        MODEL,
        {},
        budget,
        sampling=SAMPLING,
        journal_dir=tmp_path,
        **kw,
    )


def _lost(row: dict) -> list[dict]:
    return json.loads(row["provenance"] or "{}").get("lost_attempts") or []


@pytest.mark.parametrize("fault", [{"stream_cut": 0.4}, {"stream_stall": 0.4, "stall_s": 3.0}])
def test_a_cut_or_silent_stream_is_priced_from_its_generation_and_counted_before_the_retry(
    fault, store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server({"seed": 7, "price_per_token": PRICE, "endpoints": {"chat": fault}})
    ref, s = _run(
        store,
        server,
        kimi_tokenizer,
        prompts(24, "chat"),
        tmp_path,
        next(iter(fault)),
        stream_idle_timeout_s=0.5,
        cost_lookup_delay_s=0.01,
    )
    assert s["complete"] and s["counts"]["ok"] == 24, s
    rows = store.read_table(ref).to_pylist()
    lost = [a for r in rows for a in _lost(r)]
    assert len(lost) == s["counts"]["lost_attempts"] == sum(server.stats()["faults"]["chat"].values()) >= 5
    assert {a["cost_source"] for a in lost} == {"generation_lookup"} and all(a["generation_id"] for a in lost)
    stats = server.stats()
    # every generation the provider billed, answered or lost, is in the stage's cost
    assert s["cost_usd"] == pytest.approx(stats["billed_usd"], rel=1e-6)
    assert stats["generations"] == 24 + len(lost)
    # and in the committed rows, so a resume elsewhere prices the stage the same
    total = sum(r["usage"]["cost_usd"] for r in rows) + sum(
        json.loads(r["provenance"]).get("lost_cost_usd") or 0 for r in rows
    )
    assert total == pytest.approx(stats["billed_usd"], rel=1e-6)


def test_keep_alive_comments_keep_a_slow_stream_alive(store, start_dev_server, kimi_tokenizer, tmp_path):
    """1.5 s before the first token, a comment every 0.2 s, an idle timeout of 0.5 s: nothing is cut."""
    server = start_dev_server(
        {
            "price_per_token": PRICE,
            "endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 1.5}, "keepalive_s": 0.2}},
        }
    )
    _ref, s = _run(store, server, kimi_tokenizer, prompts(8, "chat"), tmp_path, "slow", stream_idle_timeout_s=0.5)
    assert s["complete"] and s["counts"]["ok"] == 8 and s["counts"]["lost_attempts"] == 0, s
    assert s["cost_usd"] == pytest.approx(server.stats()["billed_usd"], rel=1e-6)


def test_a_timed_out_plain_request_is_counted_at_the_estimate(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Without streaming, a request the client stopped waiting for is billed by OpenRouter all the
    same and names no generation: it is counted at the budget's estimate (an upper bound)."""
    server = start_dev_server(
        {"seed": 3, "price_per_token": PRICE, "endpoints": {"chat": {"timeout": 0.3, "timeout_sleep_s": 2.0}}}
    )
    ref, s = _run(
        store,
        server,
        kimi_tokenizer,
        prompts(16, "chat"),
        tmp_path,
        "plain-timeout",
        stream=False,
        request_timeout_s=1.0,
    )
    assert s["complete"] and s["counts"]["ok"] == 16, s
    lost = [a for r in store.read_table(ref).to_pylist() for a in _lost(r)]
    assert lost and {a["cost_source"] for a in lost} == {"estimate"}
    assert s["cost_usd"] >= server.stats()["billed_usd"] - 1e-9  # never less than what was billed


def test_the_history_reasoning_reaches_a_provider_that_reads_only_documented_fields(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    """A tool-call turn's reasoning is rendered in the next prompt (Kimi keeps it within the
    trajectory). Sent as `reasoning_content` (undocumented), a provider reading only OpenRouter's
    documented fields drops it: it answers a shorter prompt than the prompt ids we train on,
    which its `usage.prompt_tokens` shows. Sent as `reasoning`, the counts agree."""
    history = [
        {"role": "user", "content": "Weather in Lisbon?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants Lisbon's weather: call it.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Lisbon: 21C, sun"},
    ]
    todo = [
        {
            "sample_id": f"r{i}",
            "dataset": "chat",
            "messages": json.dumps(
                history + [{"role": "user", "content": f"And tomorrow, case {i}?"}][: 3 if i % 2 else 4]
            ),
            "tools": json.dumps(WEATHER),
            "route": "overflow",
        }
        for i in range(6)
    ]
    server = start_dev_server({"price_per_token": PRICE})
    ref, s = _run(store, server, kimi_tokenizer, todo, tmp_path, "reasoning-history")
    assert s["complete"] and s["counts"]["ok"] == 6, s
    for r in store.read_table(ref).to_pylist():
        assert r["usage"]["prompt_tokens"] == len(r["prompt_ids"]), r["sample_id"]


def test_moderation_blocks_never_trip_the_breaker(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Ten flagged prompts in a row are ten failed prompts, not a broken config."""
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"moderation": 1.0}}})
    _ref, s = _run(store, server, kimi_tokenizer, prompts(20, "chat"), tmp_path, "moderated", max_identical_errors=3)
    assert s["complete"] and s["stopped_reason"] is None and s["counts"]["failed"] == 20, s


def test_after_a_trip_every_held_sample_stays_pending_whatever_comes_back(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    """Answers still in flight when the breaker trips (successes, other errors) used to release
    the held failures as permanent rows; now the samples that got the tripping error stay pending."""
    server = start_dev_server(
        {
            "seed": 11,
            "price_per_token": PRICE,
            "endpoints": {"chat": {"bad_request": 0.85, "latency": {"dist": "uniform", "low": 0.0, "high": 0.1}}},
        }
    )
    ref, s = _run(
        store, server, kimi_tokenizer, prompts(80, "chat"), tmp_path, "tripped", max_identical_errors=3, concurrency=8
    )
    assert s["stopped_reason"] == StopReason.REPEATED_ERROR, s
    committed = store.committed_sample_ids(ref)
    answered = set(server.stats()["answered"].get("chat", {}))
    assert s["counts"]["failed"] == 0 and committed <= answered  # nothing committed but answers
    assert store.get_json(ref, "failures.json") == {}


def test_long_prompts_keep_full_concurrency_under_a_budget_that_allows_it(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    """16 requests of ~6k prompt tokens and at most 160 answer tokens cost at most
    16 x (6k x 1e-6 + 160 x 1e-5) = ~$0.12: a $0.5 cap allows all 16 in flight at once. The budget
    prices them from the model list's prices before the first answer, instead of a first guess
    (here $0.05 a request, which would hold 10) or a ratio of whole answers."""
    # 3 s to answer: all 16 are sent long before the first answer, however loaded the machine
    server = start_dev_server(
        {"price_per_token": PRICE, "endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 3.0}}}}
    )
    long = " ".join(f"Record {i}: the station logged a reading of {i % 97} units." for i in range(400))
    todo = [
        {
            "sample_id": f"l{i:02d}",
            "dataset": "chat",
            "route": "overflow",
            "tools": json.dumps(WEATHER),
            "messages": json.dumps([{"role": "user", "content": f"{long}\nSummarise case {i}."}]),
        }
        for i in range(16)
    ]
    assert len(kimi_tokenizer.encode(long)) > 5000
    _ref, s = _run(
        store,
        server,
        kimi_tokenizer,
        todo,
        tmp_path,
        "long-prompts",
        budget=0.5,
        concurrency=16,
        first_cost_estimate_usd=0.05,
    )
    assert s["complete"] and s["counts"]["ok"] == 16, s
    assert server.stats()["max_in_flight"]["chat"] == 16


def test_an_error_event_that_was_not_billed_is_not_priced_on_resume(store, start_dev_server, kimi_tokenizer, tmp_path):
    """A stream that opened and then carried only an error event (no output, no usage) is priced
    by its generation's record ($0: not billed); the resume prices only what may have been billed."""
    todo = prompts(3, "chat")
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"error_in_body": 1.0}}})
    _ref, s = _run(
        store, server, kimi_tokenizer, todo, tmp_path, "error-events", max_attempts=2, cost_lookup_delay_s=0.01
    )
    assert s["stopped_reason"] == "retryable_failures" and s["cost_usd"] == 0, s
    server = start_dev_server({"price_per_token": PRICE})
    _ref, s = _run(store, server, kimi_tokenizer, todo, tmp_path, "error-events", cost_lookup_delay_s=0.01)
    assert s["complete"] and s["counts"]["lost_attempts"] == 0, s
    assert s["cost_usd"] == pytest.approx(server.stats()["billed_usd"], rel=1e-6)


def test_a_wave_of_answers_sends_the_next_wave_before_decoding_any(
    store, start_dev_server, kimi_tokenizer, tmp_path, monkeypatch
):
    """With a fixed latency all C answers of a wave land together. Each worker sends its next
    request before any answer of the wave is decoded: decoding on the send path held the wave's
    last request back by the C decodes before it (0.87 of C/L at C = 256, L = 0.5 s; issue 33).
    The dev server's real streamed answers are held here and released a wave at a time, so the
    order is the client's, not the scheduler's."""
    import asyncio

    import aiohttp

    from eagle3_data.stages.generate import openrouter, openrouter_http

    C, waves = 4, 3
    server = start_dev_server({"seed": 7, "price_per_token": PRICE})
    log: list[tuple[str, str]] = []
    sample_of: dict[int, str] = {}
    held: list[str] = []
    gate: list[asyncio.Future] = []
    decode = openrouter_http.Received.answer

    def logged_answer(received):
        log.append(("decode", sample_of[id(received)]))
        return decode(received)

    class Waves(openrouter_http.SdkPost):
        async def stream(self, body, headers, on_open=None):
            sid = headers["X-Eagle3-Sample-Id"]
            received = await super().stream(body, headers, on_open)
            sample_of[id(received)] = sid
            if not gate or gate[-1].done():
                gate.append(asyncio.get_running_loop().create_future())
            held.append(sid)
            if len(held) % C == 0:
                gate[-1].set_result(None)  # the wave lands at once
            await gate[-1]
            return received

    write_bytes = aiohttp.ClientRequest.write_bytes

    async def logged_write(request, *args, **kwargs):  # the request's body leaves (aiohttp: a task of its own)
        if sid := request.headers.get("X-Eagle3-Sample-Id"):
            log.append(("send", sid))
        return await write_bytes(request, *args, **kwargs)

    monkeypatch.setattr(openrouter, "SdkPost", Waves)
    monkeypatch.setattr(openrouter_http.Received, "answer", logged_answer)
    monkeypatch.setattr(aiohttp.ClientRequest, "write_bytes", logged_write)
    _ref, s = _run(store, server, kimi_tokenizer, prompts(C * waves, "chat"), tmp_path, "waves", concurrency=C)
    assert s["complete"] and s["counts"]["ok"] == C * waves, s
    sends = [i for i, (kind, _) in enumerate(log) if kind == "send"]
    for w in range(waves - 1):
        wave = set(held[w * C : (w + 1) * C])
        first_decode = min(i for i, (kind, sid) in enumerate(log) if kind == "decode" and sid in wave)
        assert max(sends[(w + 1) * C : (w + 2) * C]) < first_decode, (w, log)
