"""`openrouter_http.SdkPost`: the overflow client's send path keeps the openai SDK's auth headers and
exception classes (what the retry loop and the stop rules in `_sample` branch on) while skipping
its per-request pipeline; streamed answers are assembled from OpenRouter's SSE shapes (keep-alive
comments, mid-stream errors, usage in the last chunk), and a request that reached the provider
without an answer is `AttemptLost` with its generation id, so it can be priced."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from aiohttp import web

from eagle3_data.stages.generate.openrouter import run_event_loop
from eagle3_data.stages.generate.openrouter_http import AttemptLost, SdkPost

KEY = "sk-or-test-secret-123"


async def _with_server(handler, body, stream=False, idle_s=2.0):
    seen = {}

    async def route(request: web.Request) -> web.Response:
        seen["auth"] = request.headers.get("Authorization")
        seen["agent"] = request.headers.get("User-Agent")
        seen["sample"] = request.headers.get("X-Eagle3-Sample-Id")
        seen["body"] = await request.json()
        return await handler(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = SdkPost(f"http://127.0.0.1:{port}/v1", KEY, 4, 2.0, stream_idle_timeout_s=idle_s)
    send = client.stream if stream else client.post
    try:
        received = await send(
            json.dumps(body).encode(), {"X-Eagle3-Sample-Id": "s1"}, seen.setdefault("opened", []).append
        )
        return received.answer(), seen  # decoded as the client does, after the request's slot is handed on
    except Exception as exc:  # returned, not raised: the test inspects it after cleanup
        return exc, seen
    finally:
        await client.close()
        await runner.cleanup()


def _call(handler, body=None, **kw):
    return run_event_loop(
        _with_server(handler, body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, **kw)
    )


def _answer(status, text, headers=None):
    async def handler(request):
        return web.Response(status=status, text=text, headers=headers, content_type="application/json")

    return handler


def test_ok_answer_is_decoded_and_sent_with_the_sdk_auth_and_headers():
    got, seen = _call(_answer(200, '{"choices": [], "id": "gen-1"}'))
    assert got == {"choices": [], "id": "gen-1"}
    assert seen["auth"] == f"Bearer {KEY}"
    assert seen["agent"].startswith("AsyncOpenAI/Python")
    assert seen["sample"] == "s1" and seen["body"]["model"] == "m"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (402, openai.APIStatusError),
        (429, openai.RateLimitError),
        (502, openai.InternalServerError),
    ],
)
def test_error_statuses_raise_the_sdk_classes_with_body_and_headers(status, cls):
    exc, _ = _call(_answer(status, '{"error": {"code": %d, "message": "nope"}}' % status, {"Retry-After": "7"}))
    assert type(exc) is cls and exc.status_code == status
    assert exc.response.headers["retry-after"] == "7"  # what backoff_s honours
    assert exc.response.json()["error"]["message"] == "nope" and "nope" in str(exc)
    assert KEY not in str(exc) and KEY not in repr(exc.request.headers)


def test_a_non_json_ok_answer_is_an_attempt_lost_with_its_generation_id():
    exc, seen = _call(_answer(200, "{not json", {"X-Generation-Id": "gen-9"}))
    assert isinstance(exc, AttemptLost) and exc.generation_id == "gen-9" and "malformed" in exc.why
    assert seen["opened"] == ["gen-9"]  # named before the body was read: a kill then leaves it in the journal


def test_transport_failures_are_the_sdk_connection_and_timeout_errors():
    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(text="{}")

    exc, _ = _call(slow)
    assert type(exc) is openai.APITimeoutError

    async def refused():
        client = SdkPost("http://127.0.0.1:9/v1", KEY, 1, 2.0)  # port 9 (discard): nothing listens
        try:
            await client.post(b"{}", {})
        except Exception as e:
            return e
        finally:
            await client.close()

    exc = run_event_loop(refused())
    assert type(exc) is openai.APIConnectionError and KEY not in str(exc)


def _sse(*events: str, headers=None, cut_after: int | None = None, stall_s: float = 0.0):
    """A handler streaming `events` (raw SSE text pieces); `cut_after`: drop the connection after
    that many; `stall_s`: go silent that long before the rest."""

    async def handler(request):
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await r.prepare(request)
        for i, e in enumerate(events):
            if i == cut_after:
                request.transport.close()
                return r
            if stall_s and i == len(events) // 2:
                await asyncio.sleep(stall_s)
            await r.write(e.encode())
        await r.write_eof()
        return r

    return handler


def _chunk(delta=None, finish=None, **extra) -> str:
    body = {
        "id": "gen-s",
        "model": "moonshotai/kimi-k2.5",
        "provider": "Moonshot AI",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
        **extra,
    }
    return "data: " + json.dumps(body) + "\n\n"


STREAM = (
    ": OPENROUTER PROCESSING\n\n",
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning": "Think "}),
    ": OPENROUTER PROCESSING\n\n",
    _chunk({"reasoning": "hard."}),
    _chunk({"content": "Hel"}),
    _chunk({"content": "lo"}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": ""}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
    # a data field split over two lines, as the SSE spec allows
    'data: {"id": "gen-s", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, \n'
    'data: "function": {"arguments": "1}"}}]}, "finish_reason": "tool_calls"}]}\n\n',
    "data: "
    + json.dumps({"id": "gen-s", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "cost": 0.01}})
    + "\n\n",
    "data: [DONE]\n\n",
)


def test_a_stream_is_assembled_into_the_answer_shape_comments_skipped():
    got, seen = _call(_sse(*STREAM), stream=True)
    assert not isinstance(got, Exception), got
    message = got["choices"][0]["message"]
    assert message["reasoning"] == "Think hard." and message["content"] == "Hello"
    assert message["tool_calls"] == [
        {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert got["choices"][0]["finish_reason"] == "tool_calls" and got["usage"]["completion_tokens"] == 9
    assert got["id"] == "gen-s" and seen["opened"] == ["gen-s"]  # named by its first chunk (no header)


def test_a_mid_stream_error_event_is_the_choice_error_of_a_billed_partial_answer():
    error = {"code": "server_error", "message": "Provider disconnected unexpectedly"}
    events = (
        _chunk({"content": "partial"}),
        _chunk({"content": ""}, "error", error=error),
        "data: "
        + json.dumps({"id": "gen-s", "choices": [], "usage": {"completion_tokens": 3, "cost": 0.001}})
        + "\n\n",
        "data: [DONE]\n\n",
    )
    got, _ = _call(_sse(*events, headers={"X-Generation-Id": "gen-h"}), stream=True)
    choice = got["choices"][0]
    assert choice["finish_reason"] == "error" and choice["error"] == error
    assert choice["message"]["content"] == "partial" and got["usage"]["cost"] == 0.001


@pytest.mark.parametrize("fault", ["cut", "idle", "no_end"])
def test_a_stream_that_opened_and_gave_no_answer_is_an_attempt_lost_named_by_its_generation(fault):
    events = STREAM[:-3] if fault == "no_end" else STREAM  # ends before its finish reason
    handler = _sse(
        *events,
        headers={"X-Generation-Id": "gen-h"},
        cut_after=4 if fault == "cut" else None,
        stall_s=1.0 if fault == "idle" else 0.0,
    )
    exc, seen = _call(handler, stream=True, idle_s=0.3)
    assert isinstance(exc, AttemptLost), exc
    assert exc.generation_id == "gen-h" and seen["opened"] == ["gen-h"]


def test_a_stream_refused_before_it_opened_is_the_sdk_status_error():
    exc, seen = _call(
        _answer(429, '{"error": {"code": 429, "message": "slow down"}}', {"Retry-After": "3"}), stream=True
    )
    assert type(exc) is openai.RateLimitError and seen["opened"] == []
