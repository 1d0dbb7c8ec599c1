"""A minimal OpenRouter-shaped chat server for the client benchmarks: the smallest server CPU per
request Python allows (asyncio protocol, no framework, one canned answer after a fixed latency,
plain or, for a request that asks `"stream": true`, the dev server's SSE events of it in one write),
so the client can be measured where the dev inference server (FastAPI, chat template, fault
draws per request) is the limit on a small shared box.

    .venv/bin/python benchmarks/minimal_server.py --port 8000 --latency 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

ANSWER_DICT = {
    "id": "gen-minimal",
    "provider": "minimal",
    "model": "moonshotai/kimi-k2.5",
    "object": "chat.completion",
    "created": 0,
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "native_finish_reason": "stop",
            "message": {
                "role": "assistant",
                "content": "A benchmark answer. " * 10,
                "reasoning": "Short reasoning here. " * 10,
            },
        }
    ],
    "usage": {
        "prompt_tokens": 12,
        "completion_tokens": 6,
        "total_tokens": 18,
        "cost": 1e-06,
        "completion_tokens_details": {"reasoning_tokens": 2},
    },
}
ANSWER = json.dumps(ANSWER_DICT).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(ANSWER)).encode()
    + b"\r\n\r\n"
    + ANSWER
)


def _stream_response() -> bytes:
    """The same answer as the dev server streams it (`sse_events`: ~60 events of 7-character pieces, then
    the finish, the usage and `[DONE]`), as one canned SSE body: a request whose body asks
    `"stream": true` gets this."""
    from eagle3_data.dev.inference_server.openrouter_answers import sse_events

    body = b": OPENROUTER PROCESSING\n\n" + b"".join(sse_events(ANSWER_DICT))
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


STREAM_RESPONSE = b""  # built at start (serve)
HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
_MODELS = json.dumps({"data": [{"id": ANSWER_DICT["model"], "canonical_slug": ANSWER_DICT["model"]}]}).encode()
MODELS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_MODELS)).encode()
    + b"\r\n\r\n"
    + _MODELS
)  # GET /v1/models: the client's identity pin reads the model's names


class Chat(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection (what the clients send)."""

    latency = 0.5

    def connection_made(self, transport):
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            body, self.buf = rest[:length], rest[length:]
            if head.startswith(b"GET"):
                self.transport.write(MODELS if head.split(b" ", 2)[1].endswith(b"/models") else HEALTH)
            else:
                stream = b'"stream":true' in body or b'"stream": true' in body
                asyncio.get_running_loop().call_later(
                    self.latency, self._answer, STREAM_RESPONSE if stream else RESPONSE
                )

    def _answer(self, response: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(response)


async def serve(port: int, latency: float) -> None:
    global STREAM_RESPONSE
    Chat.latency = latency
    STREAM_RESPONSE = _stream_response()
    server = await asyncio.get_running_loop().create_server(Chat, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


class MinimalServerProcess:
    """The server as a child process on a free 127.0.0.1 port (`url`, `proc`, `stop()` by PID)."""

    def __init__(self, latency_s: float):
        from eagle3_data.dev.processes import free_port, wait_http_ok

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--port", str(self.port), "--latency", str(latency_s)], stdin=subprocess.DEVNULL
        )
        try:
            wait_http_ok(f"{self.url}/health", [self.proc], "minimal chat server", None, 30)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency", type=float, default=0.5)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.run(serve(a.port, a.latency))
    except ImportError:
        asyncio.run(serve(a.port, a.latency))
