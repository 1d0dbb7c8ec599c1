"""`openrouter.SdkPost`: the overflow client's send path keeps the openai SDK's auth headers and
exception classes (what the retry loop and the stop rules in `_sample` branch on) while skipping
its per-request pipeline."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp import web

from eagle3_data.generation.openrouter import SdkPost, run_event_loop

KEY = "sk-or-test-secret-123"


async def _with_server(handler, body):
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
    client = SdkPost(f"http://127.0.0.1:{port}/v1", KEY, 4, 2.0)
    try:
        return await client.post(body, {"X-Eagle3-Sample-Id": "s1"}), seen
    except Exception as exc:  # returned, not raised: the test inspects it after cleanup
        return exc, seen
    finally:
        await client.close()
        await runner.cleanup()


def _call(handler, body=None):
    return run_event_loop(_with_server(handler, body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))


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


@pytest.mark.parametrize(("status", "cls"), [(400, openai.BadRequestError), (401, openai.AuthenticationError),
                                             (402, openai.APIStatusError), (429, openai.RateLimitError),
                                             (502, openai.InternalServerError)])
def test_error_statuses_raise_the_sdk_classes_with_body_and_headers(status, cls):
    exc, _ = _call(_answer(status, '{"error": {"code": %d, "message": "nope"}}' % status, {"Retry-After": "7"}))
    assert type(exc) is cls and exc.status_code == status
    assert exc.response.headers["retry-after"] == "7"  # what backoff_s honours
    assert exc.response.json()["error"]["message"] == "nope" and "nope" in str(exc)
    assert KEY not in str(exc) and KEY not in repr(exc.request.headers)


def test_a_non_json_ok_answer_is_a_value_error():
    exc, _ = _call(_answer(200, "{not json"))
    assert isinstance(exc, ValueError)


def test_transport_failures_are_the_sdk_connection_and_timeout_errors():
    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(text="{}")

    exc, _ = _call(slow)
    assert type(exc) is openai.APITimeoutError

    async def refused():
        client = SdkPost("http://127.0.0.1:9/v1", KEY, 1, 2.0)  # port 9 (discard): nothing listens
        try:
            await client.post({}, {})
        except Exception as e:
            return e
        finally:
            await client.close()

    exc = run_event_loop(refused())
    assert type(exc) is openai.APIConnectionError and KEY not in str(exc)
