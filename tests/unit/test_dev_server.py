"""The dev inference server's generator, fault config and wire protocol (in-process ASGI, no ports)."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from eagle3_data.dev.faults import EndpointFaults, ServerConfig, config_from_dict
from eagle3_data.dev.text_model import DevTextModel
from eagle3_data.errors import UserError
from tests.generation_calls import MODEL

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
            },
        },
    }
]


@pytest.fixture(scope="module")
def prompt_ids(kimi_tokenizer):
    return kimi_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Find it."}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_generation_is_kimi_format_and_deterministic(kimi_tokenizer, prompt_ids):
    model = DevTextModel(kimi_tokenizer)
    a = model.generate(prompt_ids, max_new_tokens=4000, seed=5)
    assert a == model.generate(prompt_ids, max_new_tokens=4000, seed=5)
    assert any(model.generate(prompt_ids, max_new_tokens=4000, seed=s).output_ids != a.output_ids for s in range(6, 10))
    im_end, think_end = (kimi_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "</think>"))
    texts = set()
    for seed in range(30):
        g = model.generate(prompt_ids, max_new_tokens=4000, seed=seed)
        assert g.finish_reason == "stop" and g.output_ids[-1] == im_end and g.output_ids.count(think_end) == 1
        text = kimi_tokenizer.decode(g.output_ids, skip_special_tokens=False)
        assert text.startswith(g.reasoning + "</think>" + g.content) and text.endswith("<|im_end|>")
        for call in g.tool_calls:
            assert call["id"] == f"functions.lookup:{g.tool_calls.index(call)}"
            args = json.loads(call["function"]["arguments"])
            assert set(args) == {"query", "limit", "exact", "unit"} and args["unit"] in ("c", "f")
            assert isinstance(args["limit"], int) and isinstance(args["exact"], bool)
        texts.add(g.content)
    assert sum(bool(model.generate(prompt_ids, max_new_tokens=4000, seed=s).tool_calls) for s in range(30)) >= 10
    # canonical when no split rate: ids == encode(text)
    g = model.generate(prompt_ids, max_new_tokens=4000, seed=1)
    assert (
        kimi_tokenizer.encode(kimi_tokenizer.decode(g.output_ids, skip_special_tokens=False), add_special_tokens=False)
        == g.output_ids
    )


def test_noncanonical_splits_keep_text_and_are_counted(kimi_tokenizer, prompt_ids):
    model = DevTextModel(kimi_tokenizer, {"splitty": 0.2})
    plain = DevTextModel(kimi_tokenizer).generate(prompt_ids, max_new_tokens=4000, seed=3)
    g = model.generate(prompt_ids, max_new_tokens=4000, seed=3, dataset="splitty")
    assert g.noncanonical_splits > 0
    assert len(g.output_ids) == len(plain.output_ids) + g.noncanonical_splits
    text = kimi_tokenizer.decode(g.output_ids, skip_special_tokens=False)
    assert text == kimi_tokenizer.decode(plain.output_ids, skip_special_tokens=False)
    assert kimi_tokenizer.encode(text, add_special_tokens=False) == plain.output_ids  # re-encoding merges back
    assert model.generate(prompt_ids, max_new_tokens=4000, seed=3, dataset="other").noncanonical_splits == 0


def test_truncation_and_thinking_off(kimi_tokenizer, prompt_ids):
    model = DevTextModel(kimi_tokenizer)
    g = model.generate(prompt_ids, max_new_tokens=5, seed=2)
    assert g.finish_reason == "length" and len(g.output_ids) == 5 and g.content == ""
    assert g.reasoning == kimi_tokenizer.decode(g.output_ids)
    no_think = kimi_tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True, return_dict=False, thinking=False
    )
    g = model.generate(no_think, max_new_tokens=4000, seed=2)
    assert g.reasoning is None and kimi_tokenizer.convert_tokens_to_ids("</think>") not in g.output_ids


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_generations_are_qwen3_format(qwen3_tokenizer, thinking):
    """The stand-in writes the tokenizer's family: Qwen3's `<think>` block and `<tool_call>` JSON
    bodies, which the Qwen3 format parses back whole, and the message its server's parsers give."""
    from eagle3_data.chat_format import get_output_format

    fmt = get_output_format(qwen3_tokenizer, thinking=thinking)
    prompt = fmt.generation_prompt_ids([{"role": "user", "content": "Find it."}], TOOLS)
    model = DevTextModel(qwen3_tokenizer)
    assert model.prompt_tools(prompt) == TOOLS
    think, think_end, call_begin = (
        qwen3_tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>")
    )
    calls = 0
    for seed in range(20):
        g = model.generate(prompt, max_new_tokens=4000, seed=seed)
        assert g.finish_reason == "stop" and g.output_ids[-1] == qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert (g.output_ids[:1] == [think] and g.output_ids.count(think_end) == 1) == thinking
        assert (g.reasoning is not None) == thinking
        parsed = fmt.parse_ids(g.output_ids)
        assert parsed.message.tool_tail is None and len(parsed.message.tool_calls) == len(g.tool_calls)
        assert g.output_ids.count(call_begin) == len(g.tool_calls)
        for i, call in enumerate(g.tool_calls):
            assert call["id"] == f"call_{i}" and set(json.loads(call["function"]["arguments"])) == {
                "query",
                "limit",
                "exact",
                "unit",
            }
        text = qwen3_tokenizer.decode(g.output_ids)
        assert qwen3_tokenizer.encode(text, add_special_tokens=False) == g.output_ids
        calls += len(g.tool_calls)
    assert calls >= 10
    cut = model.generate(prompt, max_new_tokens=5, seed=2)
    assert cut.finish_reason == "length" and len(cut.output_ids) == 5 and not cut.tool_calls


def test_fault_config_is_validated_and_draws_are_seeded():
    with pytest.raises(UserError, match="unknown keys"):
        config_from_dict({"endpoints": {"chat": {"rate_limt": 0.1}}})
    with pytest.raises(UserError, match="endpoints.gpu"):
        config_from_dict({"endpoints": {"gpu": {}}})
    cfg = config_from_dict({"seed": 1, "endpoints": {"chat": {"rate_limit": 0.2, "server_error": 0.1}}})
    draws = [cfg.faults("chat").draw(cfg.rng("chat", f"k{i}", 1))[0] for i in range(2000)]
    assert draws == [cfg.faults("chat").draw(cfg.rng("chat", f"k{i}", 1))[0] for i in range(2000)]
    assert 0.17 < draws.count("rate_limit") / 2000 < 0.23 and 0.07 < draws.count("server_error") / 2000 < 0.13
    lat = EndpointFaults(latency={"dist": "lognormal", "mean": 0.5, "sigma": 0.5})
    rng = random.Random(0)
    assert 0.45 < sum(lat._latency(rng) for _ in range(4000)) / 4000 < 0.55


@pytest.fixture(scope="module")
def app(kimi_tokenizer):
    from eagle3_data.dev.inference_server import create_app

    return create_app(kimi_tokenizer, ServerConfig())


def call(app, method: str, path: str, **kw) -> httpx.Response:
    import asyncio

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dev") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_generate_and_chat_agree(app, kimi_tokenizer, prompt_ids):
    msgs = [{"role": "user", "content": "Find it."}]
    gen = call(
        app,
        "POST",
        "/generate",
        json={"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 4000, "sampling_seed": 4}, "rid": "r1"},
    ).json()
    assert set(gen) == {"text", "output_ids", "meta_info"}
    meta = gen["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == len(prompt_ids)
    assert meta["finish_reason"] == {"type": "stop", "matched": kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert meta["completion_tokens"] == len(gen["output_ids"])
    chat = call(
        app,
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "tools": TOOLS, "seed": 4, "max_tokens": 4000},
    ).json()
    assert chat["id"].startswith("gen-") and chat["provider"]
    choice = chat["choices"][0]
    msg = choice["message"]
    text = msg["reasoning"] + "</think>" + msg["content"]
    if msg.get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls"
        text += (
            "<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{c['function']['arguments']}<|tool_call_end|>"
                for c in msg["tool_calls"]
            )
            + "<|tool_calls_section_end|>"
        )
    assert text + "<|im_end|>" == kimi_tokenizer.decode(gen["output_ids"], skip_special_tokens=False)
    usage = chat["usage"]
    assert usage["completion_tokens"] == len(gen["output_ids"]) and usage["cost"] > 0
    assert usage["completion_tokens_details"]["reasoning_tokens"] == gen["output_ids"].index(
        kimi_tokenizer.convert_tokens_to_ids("</think>")
    )
    batch = call(
        app,
        "POST",
        "/generate",
        json={"input_ids": [prompt_ids, prompt_ids[:-3]], "sampling_params": {"max_new_tokens": 7}},
    ).json()
    assert len(batch) == 2 and batch[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_injected_faults_on_the_wire(app, kimi_tokenizer):
    msgs = [{"role": "user", "content": "Hello there."}]
    assert call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"rate_limt": 1}}}).status_code == 400
    try:
        call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"rate_limit": 1.0, "retry_after_s": 2.5}}})
        r = call(app, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": msgs})
        assert r.status_code == 429 and r.headers["retry-after"] == "2.5" and r.json()["error"]["code"] == 429
        call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"malformed_json": 1.0}}})
        with pytest.raises(json.JSONDecodeError):
            json.loads(call(app, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": msgs}).text)
        call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"credits_after": 1}}})
        codes = [
            call(app, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": msgs}).status_code
            for _ in range(3)
        ]
        assert codes == [200, 402, 402]
        call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"trim_whitespace": 1.0, "empty_content": 0.0}}})
        for i in range(20):
            m = call(
                app,
                "POST",
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]},
            ).json()
            content = m["choices"][0]["message"]["content"]
            assert content == content.strip()
        call(
            app,
            "POST",
            "/dev/config",
            json={"endpoints": {"chat": {"rewrite_tool_call_ids": 1.0, "reserialize_arguments": 1.0}}},
        )
        calls: list[Any] = []
        for i in range(10):
            m = call(
                app,
                "POST",
                "/v1/chat/completions",
                json={"model": MODEL, "tools": TOOLS, "messages": [{"role": "user", "content": f"t{i}"}]},
            ).json()
            calls += m["choices"][0]["message"].get("tool_calls") or []
        assert calls and all(c["id"].startswith("call_") for c in calls)
        assert all(", " not in c["function"]["arguments"] and json.loads(c["function"]["arguments"]) for c in calls)
        assert call(app, "GET", "/dev/stats").json()["requests"]["chat"]
    finally:
        call(app, "POST", "/dev/config", json={})
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/get_model_info").json()["is_generation"] is True


def test_a_stream_error_is_billed_and_its_record_can_come_late(app):
    """`stream_error`: OpenRouter's mid-stream `error` data event (finish_reason "error", no usage)
    after half the answer; the generation is billed (its prompt and the tokens sent) and its
    record at GET /v1/generation?id= answers 404 for `record_delay_s`."""
    import time

    msgs = [{"role": "user", "content": "Hello there."}]
    try:
        call(app, "POST", "/dev/config", json={"endpoints": {"chat": {"stream_error": 1.0, "record_delay_s": 0.3}}})
        r = call(app, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "stream": True})
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        chunks = [json.loads(e) for e in events[:-1]]
        last, gid = chunks[-1], r.headers["x-generation-id"]
        assert last["id"] == gid and last["object"] == "chat.completion.chunk" and last["error"]["code"] == 502
        assert last["choices"] == [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]
        assert not any("usage" in c for c in chunks)
        assert call(app, "GET", "/v1/generation", params={"id": gid}).status_code == 404  # not yet
        time.sleep(0.35)
        record = call(app, "GET", "/v1/generation", params={"id": gid}).json()["data"]
        assert record["finish_reason"] == "error" and record["native_tokens_prompt"] > 0
        assert record["total_cost"] > 0 and record["native_tokens_completion"] > 0
        assert call(app, "GET", "/dev/stats").json()["billed_usd"] == pytest.approx(record["total_cost"])
    finally:
        call(app, "POST", "/dev/config", json={})


def test_generate_is_protocol_true(app, kimi_tokenizer, prompt_ids):
    """The dev server rejects what SGLang 0.5.23 rejects, in its shapes (tests/unit/test_sglang_oracle.py
    checks the schema texts against SGLang's own contract check)."""
    r = call(app, "POST", "/generate", json={"input_ids": prompt_ids, "sampling_params": {"seed": 3}})
    assert r.status_code == 400 and r.json()["error"].startswith(
        "unknown field `seed`, expected one of `max_new_tokens`"
    )
    r = call(app, "POST", "/generate", json={"input_ids": ["a", "b"]})
    assert r.status_code == 400 and r.json() == {"error": 'invalid type: string "a", expected a sequence'}
    r = call(app, "POST", "/generate", json={"input_ids": [1, 163840]})
    assert r.status_code == 400 and "out of the vocabulary" in r.json()["error"]["message"]
    r = call(
        app,
        "POST",
        "/generate",
        json={
            "input_ids": prompt_ids,
            "rid": "x.0",
            "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [163586]},
        },
    )
    meta = r.json()["meta_info"]
    assert r.status_code == 200 and meta["id"] == "x.0" and meta["weight_version"] == "dev"
    assert meta["completion_tokens"] == len(r.json()["output_ids"])
    assert call(app, "GET", "/model_info").json()["weight_version"] == "dev"


def test_duplicate_rid_while_registered_is_a_400(app, prompt_ids):
    import asyncio

    call(app, "POST", "/dev/config", json={"endpoints": {"generate": {"latency": {"dist": "fixed", "mean": 0.5}}}})
    try:

        async def both():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dev") as c:
                body = {"input_ids": prompt_ids, "rid": "same.0", "sampling_params": {"max_new_tokens": 4}}
                return await asyncio.gather(c.post("/generate", json=body), c.post("/generate", json=body))

        codes = sorted(r.status_code for r in asyncio.run(both()))
        assert codes == [200, 400]
    finally:
        call(app, "POST", "/dev/config", json={})


def test_warmup_and_an_endpoint_that_comes_back(app, prompt_ids):
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 4}}
    try:
        call(app, "POST", "/dev/config", json={"warmup_s": 3600})
        assert call(app, "GET", "/health").status_code == 503
        assert call(app, "POST", "/generate", json=body).status_code == 503
        call(app, "POST", "/dev/config", json={"refuse_first": 2})
        assert call(app, "GET", "/health").status_code == 200
        assert call(app, "POST", "/generate", json=body).status_code == 503
        assert call(app, "GET", "/health").status_code == 503  # down until both are refused
        assert call(app, "POST", "/generate", json=body).status_code == 503
        assert call(app, "GET", "/health").status_code == 200
        assert call(app, "POST", "/generate", json=body).status_code == 200
    finally:
        call(app, "POST", "/dev/config", json={})


DEV_KEY = "sk-dev-4f1c9a7e2b"


@pytest.fixture(scope="module")
def keyed_app(kimi_tokenizer):
    from eagle3_data.dev.inference_server import create_app

    return create_app(kimi_tokenizer, ServerConfig(), api_key=DEV_KEY)


GUARDED = [
    ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}]}),
    ("GET", "/v1/models", None),
    ("GET", "/model_info", None),
    ("GET", "/get_server_info", None),
]


@pytest.mark.parametrize("method, path, body", GUARDED)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", DEV_KEY, f"Basic {DEV_KEY}", f"Bearer  {DEV_KEY}", f"Bearer {DEV_KEY}x"]
)
def test_a_keyed_server_refuses_a_missing_or_wrong_key_as_sglang_does(keyed_app, method, path, body, authorization):
    """SGLang 0.5.23 with `--api-key` (srt/utils/auth.py): every route but /health, /ready and
    /metrics answers 401 with exactly `{"error":"Unauthorized"}` unless `Authorization` is
    `Bearer <key>`, before the route reads the body."""
    headers = {"Authorization": authorization} if authorization else {}
    r = call(keyed_app, method, path, headers=headers, **({"json": body} if body else {}))
    assert r.status_code == 401 and r.content == b'{"error":"Unauthorized"}', (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("method, path, body", GUARDED)
@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_a_keyed_server_answers_the_right_key(keyed_app, app, method, path, body, scheme):
    r = call(
        keyed_app, method, path, headers={"Authorization": f"{scheme} {DEV_KEY}"}, **({"json": body} if body else {})
    )
    assert r.status_code == 200, r.text
    keyless = call(app, method, path, **({"json": body} if body else {}))  # a server without a key: open
    assert keyless.status_code == 200, keyless.text


@pytest.mark.parametrize(
    "method, path", [("GET", "/health"), ("GET", "/health_generate"), ("GET", "/dev/stats"), ("OPTIONS", "/generate")]
)
def test_a_keyed_server_leaves_health_open(keyed_app, method, path):
    """Probes and the dev server's own counters need no key (SGLang: OPTIONS and /health*)."""
    assert call(keyed_app, method, path).status_code != 401


@pytest.mark.parametrize("thinking", [True, False])
def test_a_chat_request_renders_in_the_families_own_thinking_mode(kimi_tokenizer, qwen3_tokenizer, thinking):
    """The OpenRouter-shaped route renders a chat request as the family's template does in the
    requested mode: Qwen3 names it `enable_thinking` (an empty `<think></think>` block when off),
    Kimi `thinking`; the oracle is each tokenizer's own apply_chat_template."""
    from eagle3_data.dev.faults import ServerConfig
    from eagle3_data.dev.inference_server.state import ServerState

    messages = [{"role": "user", "content": "Name a prime."}]
    for tok, mode in ((kimi_tokenizer, {"thinking": thinking}), (qwen3_tokenizer, {"enable_thinking": thinking})):
        state = ServerState(tok, ServerConfig())
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **mode)
        got = tok.decode(list(state.chat_prompt(json.dumps([messages, None, thinking]))))
        assert got == expected
