"""The overflow client's wire: POST /chat/completions, plain or streamed (SSE), and OpenRouter's tables.

Streaming is the default for long answers (`generation.overflow.stream`): a Kimi-K2.5 answer with
16k+ reasoning tokens runs for many minutes, and a non-streamed request the client stops waiting
for is still billed. A stream is bounded by the silence between its bytes
(`stream_idle_timeout_s`: OpenRouter sends `: OPENROUTER PROCESSING` comments while a provider
works), not by its total length, and it names its generation as soon as it opens (the
`X-Generation-Id` header, else the first chunk's `id`), so a stream cut later can be priced from
`GET /generation?id=` instead of being paid again unseen. The assembled stream has the shape of a
non-streamed answer, so one reader (provider_answers) serves both.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from eagle3_data import json_records
from eagle3_data.errors import EndpointUnavailable
from eagle3_data.retry import WAIT_NOTE_EVERY_S

if TYPE_CHECKING:
    import aiohttp
    import httpx2

log = logging.getLogger(__name__)

SOURCE = "openrouter"
GENERATION_HEADER = "X-Generation-Id"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # json_records' check, on the events' bytes


class AttemptLost(Exception):
    """A request that reached the provider and may be billed, but gave no usable answer: a stream
    cut (connection dropped, idle past the timeout, ended without its last chunk) or an unreadable
    2xx body. `generation_id` (None when the provider never named it) prices it later."""

    def __init__(self, why: str, generation_id: str | None):
        super().__init__(why)
        self.why, self.generation_id = why, generation_id


@dataclass
class StreamAnswer:
    """An SSE stream folded into the non-streamed answer's shape (`completion()`): content,
    reasoning and `reasoning_details` concatenated in order, tool calls joined by their `index`,
    the last `finish_reason`, `usage` from the final chunk, and an `error` data event (a provider
    failing mid-generation) kept inside the choice as OpenRouter's non-streamed body has it."""

    id: str | None = None
    model: str | None = None
    provider: str | None = None
    created: int | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    details: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    chunks: int = 0

    def add(self, chunk: Any) -> None:
        # called for every event (~60 per answer): each field read once, the head's four only
        # until they are all known
        if not isinstance(chunk, dict):
            raise ValueError("an SSE data event is not a JSON object")
        self.chunks += 1
        if self.id is None or self.model is None or self.provider is None or self.created is None:
            for key in ("id", "model", "provider", "created"):
                if getattr(self, key) is None and chunk.get(key) is not None:
                    setattr(self, key, chunk[key])
        if isinstance(usage := chunk.get("usage"), dict):
            self.usage = usage
        if (error := chunk.get("error")) is not None and isinstance(error, (dict, str)):
            self.error = error if isinstance(error, dict) else {"message": error}
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            if (text := delta.get("content")) and isinstance(text, str):
                self.content.append(text)
            if (text := delta.get("reasoning")) and isinstance(text, str):
                self.reasoning.append(text)
            if details := delta.get("reasoning_details"):
                for d in details:
                    self._detail(d)
            if calls := delta.get("tool_calls"):
                for c in calls:
                    self._call(c)
            if (finish := choice.get("finish_reason")) is not None:
                self.finish_reason = finish
                self.native_finish_reason = choice.get("native_finish_reason", finish)
            if isinstance(error := choice.get("error"), dict):
                self.error = error

    def _detail(self, d: Any) -> None:
        if not isinstance(d, dict):
            return
        key = (int(d.get("index") or 0), str(d.get("type")))
        have = self.details.setdefault(key, {k: v for k, v in d.items() if k not in ("text", "data", "summary")})
        for part in ("text", "data", "summary"):
            if isinstance(d.get(part), str):
                have[part] = have.get(part, "") + d[part]

    def _call(self, c: Any) -> None:
        if not isinstance(c, dict):
            return
        have = self.calls.setdefault(
            int(c.get("index") or 0), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        if c.get("id"):
            have["id"] = c["id"]
        fn = c.get("function") or {}
        if fn.get("name"):
            have["function"]["name"] = fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            have["function"]["arguments"] += args
        elif args is not None:  # an object in one piece, as some upstreams send it
            have["function"]["arguments"] = args

    @property
    def finished(self) -> bool:
        """Whether the stream said how it ended (a finish reason, or an error event)."""
        return self.finish_reason is not None or self.error is not None

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content),
            "reasoning": "".join(self.reasoning) or None,
        }
        if self.details:
            message["reasoning_details"] = [self.details[k] for k in sorted(self.details)]
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        out: dict[str, Any] = {
            "id": self.id,
            "model": self.model,
            "provider": self.provider,
            "object": "chat.completion",
            "created": self.created,
            "usage": self.usage,
        }
        if self.error is not None and not self.chunks_with_output():
            out["error"], out["choices"] = self.error, []  # failed before any output: nothing but the error
            return out
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason,
            "native_finish_reason": self.native_finish_reason,
        }
        if self.error is not None:
            choice.update(error=self.error, finish_reason="error")
        out["choices"] = [choice]
        return out

    def chunks_with_output(self) -> bool:
        return bool(
            self.content or self.reasoning or self.details or self.calls or self.finish_reason not in (None, "error")
        )


@dataclass(slots=True)
class Received:
    """A 2xx answer read to its end, its last part not decoded yet: `answer()` decodes it.

    The client hands its request slot on before it decodes (openrouter.OverflowRun): when a burst
    of answers lands at once (every request of a wave sent together, a fixed latency), each
    answer's decode on the send path held back the next requests of the wave by the decodes
    before it, ~C x 0.4 ms at C = 256 (benchmarks/overflow_client.py). A long stream's earlier
    events are decoded as they arrive (`_read_events`): only the piece that ends it waits."""

    generation_id: str | None
    body: bytes | None = None  # a whole JSON answer (a plain request, or a stream answered whole)
    stream: StreamAnswer | None = None  # the stream's events decoded so far
    events: list[bytes] = field(default_factory=list)  # its last piece's data events, not decoded
    done: bool = False  # the stream ended with `data: [DONE]`

    def answer(self) -> dict[str, Any]:
        """The decoded answer, a stream assembled into the non-streamed shape; AttemptLost (priced
        by the generation id) when the body or an event is not JSON, or a stream ended without
        saying how."""
        if self.stream is None:
            assert self.body is not None, "a non-streamed answer is received whole"
            try:
                decoded: dict[str, Any] = json_records.loads(self.body)
                return decoded  # a cut surrogate pair in the text is a malformed answer
            except ValueError as exc:
                raise AttemptLost(f"malformed answer: {str(exc)[:120]}", self.generation_id) from exc
        answer = self.stream
        try:
            _feed(self.events, answer, lambda _: None)
        except ValueError as exc:  # an event that is not JSON
            raise AttemptLost(f"malformed stream event: {str(exc)[:120]}", self.generation_id or answer.id) from exc
        if not self.done and not answer.finished:
            raise AttemptLost(
                f"stream ended after {answer.chunks} chunks without its last one", self.generation_id or answer.id
            )
        return answer.completion()


class SdkPost:
    """POST /chat/completions as the openai SDK would send it, at a quarter of its CPU.

    The SDK builds the client: base URL normalisation, the `Authorization` header from the key
    (`auth_headers`) and its default headers (User-Agent, X-Stainless-*), and the error classes:
    a non-2xx answer becomes the SDK's own exception (`RateLimitError`, `AuthenticationError`,
    `InternalServerError`, ... via its `_make_status_error_from_response`, `.response.headers`
    carrying Retry-After), a transport failure before the provider named a generation
    `APIConnectionError`/`APITimeoutError`. What is left out is the SDK's per-request pipeline
    (option models copied twice, httpx2 URL and header objects, redirects/auth hooks, the vendored
    transport adapting aiohttp to httpx2): 2.3-3.2 ms CPU per request against 0.6-0.7 ms for this
    send over the same aiohttp (benchmarks/overflow_client.py). The SDK's own retries are off anyway (the
    client's loop sees every attempt), a static API key needs none of its token-refresh hooks, and
    OpenRouter does not redirect (a 3xx is raised like any other non-2xx status).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        concurrency: int,
        timeout_s: float,
        connect_timeout_s: float = 5.0,
        *,
        stream_idle_timeout_s: float = 180.0,
    ):
        import aiohttp
        from openai import AsyncOpenAI

        self.sdk = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.url = str(self.sdk.base_url) + "chat/completions"  # the SDK keeps a trailing slash
        self.headers = {
            k: v for k, v in {**self.sdk.default_headers, **self.sdk.auth_headers}.items() if isinstance(v, str)
        }
        self.connect_timeout_s = connect_timeout_s
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=stream_idle_timeout_s
        )
        self.records = True  # whether GET /generation?id= serves OpenRouter's generation records
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency + 8, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s),
        )

    async def check_reachable(self, within_s: float) -> None:
        """Before the first paid request: `GET {base}/models` gets an HTTP answer at all (any
        status: the host is up and speaks HTTP), else EndpointUnavailable naming the URL and what
        was tried, after `within_s` of refused or timed-out connections (never a silent wait
        through every sample's retries)."""
        import aiohttp

        url = str(self.sdk.base_url) + "models"
        started, tries, note_at = time.monotonic(), 0, 0.0
        while True:
            tries += 1
            try:
                async with self.http.get(
                    url,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=30.0, sock_connect=self.connect_timeout_s),
                ) as r:
                    await r.read()
                    return
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                last = f"{type(exc).__name__}: {str(exc)[:160]}"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return  # it accepted the connection: the requests' own retries take it from here
            waited = time.monotonic() - started
            if waited >= within_s:
                raise EndpointUnavailable(
                    f"{SOURCE} base URL {self.sdk.base_url}: no connection for {waited:.0f} s ({tries} tries of GET "
                    f"{url}, last: {last}): nothing was sent. Check the openrouter_default connection's host (or "
                    "--base-url) and the network"
                )
            if waited >= note_at:  # the first retry already says so: a wait is never silent
                log.warning(
                    "%s: waiting for %s ... (no connection for %.0f s of %g s, %d tries, last: %s)",
                    SOURCE,
                    url,
                    waited,
                    within_s,
                    tries,
                    last,
                )
                note_at = waited + WAIT_NOTE_EVERY_S
            await asyncio.sleep(min(float(tries), 3.0, max(0.0, within_s - waited)))

    async def post(
        self, body: bytes, headers: dict[str, Any], on_open: Callable[[str | None], None] | None = None
    ) -> Received:
        """A non-streamed request's answer, read whole (`Received.answer()` decodes it); raises the
        SDK's exception classes, and AttemptLost for a 2xx whose body cannot be read (it may be
        billed: its generation id, from the `X-Generation-Id` header, prices it).
        `on_open(generation_id)` is called once the status line and headers arrived."""
        import aiohttp
        import openai

        gid = None
        try:
            async with self.http.post(self.url, data=body, headers={**self.headers, **headers}) as r:
                gid = r.headers.get(GENERATION_HEADER)
                if r.status < 300 and on_open is not None:
                    on_open(gid)
                content = await r.read()
                status, raw_headers = r.status, r.raw_headers
        except asyncio.TimeoutError as exc:
            if gid is not None:
                raise AttemptLost("timed out reading the answer", gid) from exc
            raise openai.APITimeoutError(request=self._request()) from exc
        except aiohttp.ClientError as exc:
            if gid is not None:
                raise AttemptLost(f"connection lost reading the answer: {type(exc).__name__}", gid) from exc
            raise openai.APIConnectionError(request=self._request()) from exc
        if status >= 300:
            self._raise_status(status, raw_headers, content)
        return Received(gid, body=content)

    async def stream(
        self, body: bytes, headers: dict[str, Any], on_open: Callable[[str | None], None] | None = None
    ) -> Received:
        """A streamed request (`body` has `"stream": true`) read to its end (`Received.answer()`
        assembles it into the non-streamed answer's shape). `on_open(generation_id)` is called as
        soon as the generation is named (the header, else the first data event's id): from then on
        a failure is AttemptLost (priced by that id), before it the SDK's transport exceptions
        (nothing generated). An HTTP error status raises the SDK's status exception, as `post` does."""
        import aiohttp
        import openai

        answer, opened, gid = StreamAnswer(), False, None

        def named(value: str | None) -> None:
            nonlocal opened, gid
            if not opened:
                opened, gid = True, value
                if on_open is not None:
                    on_open(value)

        try:
            async with self.http.post(
                self.url, data=body, headers={**self.headers, **headers}, timeout=self.stream_timeout
            ) as r:
                if r.status >= 300:
                    self._raise_status(r.status, r.raw_headers, await r.read())
                if r.headers.get(GENERATION_HEADER):
                    named(r.headers[GENERATION_HEADER])
                if r.content_type == "application/json":  # answered whole (an error body, a server that ignores stream)
                    return Received(gid, body=await r.read())
                done, last = await _read_events(r.content, answer, named)
                if done:  # the body's end (the chunked terminator) after `[DONE]`: read, so the connection
                    await r.read()  # goes back to the pool instead of being closed (a new one per request)
        except asyncio.TimeoutError as exc:
            if opened:
                raise AttemptLost(f"stream idle past the timeout after {answer.chunks} chunks", gid) from exc
            raise openai.APITimeoutError(request=self._request()) from exc
        except aiohttp.ClientError as exc:
            if opened:
                raise AttemptLost(f"stream cut after {answer.chunks} chunks: {type(exc).__name__}", gid) from exc
            raise openai.APIConnectionError(request=self._request()) from exc
        except ValueError as exc:  # an event that is not JSON
            raise AttemptLost(f"malformed stream event: {str(exc)[:120]}", gid if opened else answer.id) from exc
        return Received(gid, stream=answer, events=last, done=done)

    def _raise_status(self, status: int, raw_headers: tuple[tuple[bytes, bytes], ...], content: bytes) -> NoReturn:
        import httpx2

        response = httpx2.Response(status, headers=raw_headers, content=content, request=self._request())
        raise self.sdk._make_status_error_from_response(response)

    async def get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """`GET {base}/{path}`'s decoded JSON, None when it answers an error status or no JSON
        (an OpenAI-compatible server without OpenRouter's tables); transport errors propagate."""
        status, body = await self._get(path, params)
        return body if status < 300 else None

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> tuple[int, Any]:
        import aiohttp

        url = str(self.sdk.base_url) + path
        try:
            async with self.http.get(
                url,
                params=params,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=30.0, sock_connect=self.connect_timeout_s),
            ) as r:
                status, content = r.status, await r.read()
        except asyncio.TimeoutError:
            return 504, None
        try:
            return status, json_records.loads(content)
        except ValueError:
            return status, None

    async def generation_cost(self, generation_id: str, tries: int, delay_s: float) -> float | None:
        """`total_cost` of OpenRouter's record of a generation (`GET /generation?id=`), which
        often answers 404 for a moment after the completion: retried `tries` times, waiting
        `delay_s`, then twice as long. None when it never gives a number. A base URL whose 404
        is not OpenRouter's error body has no such records (vLLM, SGLang): not asked again."""
        import aiohttp

        for attempt in range(tries if self.records else 0):
            try:
                status, record = await self._get("generation", {"id": generation_id})
            except aiohttp.ClientError:
                status, record = 0, None
            if status == 404 and not (isinstance(record, dict) and isinstance(record.get("error"), dict)):
                self.records = False
                log.info(
                    "%sgeneration is not OpenRouter's generation record: answers without usage.cost are priced "
                    "from generation.overflow.price_usd_per_mtok",
                    self.sdk.base_url,
                )
                return None
            cost = ((record or {}).get("data") or {}).get("total_cost") if isinstance(record, dict) else None
            if isinstance(cost, (int, float)) and not isinstance(cost, bool):
                return float(cost)
            if attempt + 1 < tries:
                await asyncio.sleep(delay_s * 2**attempt)
        return None

    def _request(self) -> httpx2.Request:
        import httpx2

        return httpx2.Request("POST", self.url)  # what the SDK's exceptions carry; no key in it

    async def close(self) -> None:
        await self.http.close()
        await self.sdk.close()


async def _read_events(
    content: aiohttp.StreamReader, answer: StreamAnswer, named: Callable[[str | None], None]
) -> tuple[bool, list[bytes]]:
    """Feed an SSE body's data events to `answer` (comment lines skipped, multi-line `data:`
    fields joined, as the SSE spec frames them) but those of the piece that ends it, returned not
    decoded (`Received.answer()` adds them, after the request's slot is handed on); True when it
    ended with `data: [DONE]`. When nothing was decoded yet (a stream in one piece, no
    `X-Generation-Id` header), its first event still names the generation here.

    Read in whatever pieces the socket gives (`iter_any`), split into lines here, and the events
    complete in a piece decoded by one parse of them as an array (`_decode_events`):
    aiohttp's line iterator (an await and a transport resume per line) and a parse per event
    (~60 per answer) made a streamed request cost the client twice the CPU of a plain one
    (benchmarks/overflow_client.py)."""
    data: list[bytes] = []  # the data lines of the event being read
    ready: list[bytes] = []  # events complete in this piece, not decoded yet

    def line(raw: bytes) -> None:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw:
            if data:
                ready.append(data[0] if len(data) == 1 else b"\n".join(data))
                data.clear()
        elif raw.startswith(b"data:"):
            data.append(raw[6:] if raw.startswith(b"data: ") else raw[5:])
        elif raw == b"data":  # a field name alone: an empty value
            data.append(b"")
        # else a comment (": OPENROUTER PROCESSING", a keep-alive) or another field: skipped

    def last() -> tuple[bool, list[bytes]]:
        """The stream's end: whether `[DONE]` came (nothing after it counts), its events not decoded."""
        done = b"[DONE]" in ready
        if done:
            del ready[ready.index(b"[DONE]") :]
        if answer.chunks == 0 and ready:
            try:
                first = json_records.loads(ready[0])
            except ValueError:
                first = None  # `Received.answer()` says so
            if isinstance(first, dict):
                named(first.get("id") if isinstance(first.get("id"), str) else None)
        return done, ready

    rest = b""
    async for piece in content.iter_any():
        buf = rest + piece
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")  # a "\r" left at the end meets its "\n" in the next piece
        *blocks, rest = buf.split(b"\n\n")  # what follows the last blank line: not ended yet
        for block in blocks:
            if not data and block.startswith(b"data: ") and b"\n" not in block:
                ready.append(block[6:])  # the usual event: one data line
                continue
            for raw in block.split(b"\n"):
                line(raw)
            line(b"")
        if b"[DONE]" in ready:
            return last()
        if ready:
            _feed(ready, answer, named)
            ready.clear()
    if rest:
        for raw in rest.split(b"\n"):
            line(raw)
    if data:
        ready.append(b"\n".join(data))
    return last()


def _feed(events: list[bytes], answer: StreamAnswer, named: Callable[[str | None], None]) -> None:
    """Decode the events and add them to `answer`, in order; ValueError at one that is not JSON,
    the events before it added first, as they came (they name the generation)."""
    chunks = _decode_events(events)
    for chunk in chunks if chunks is not None else map(json_records.loads, events):
        if isinstance(chunk, dict):
            named(chunk.get("id") if isinstance(chunk.get("id"), str) else None)
        answer.add(chunk)


def _decode_events(events: list[bytes]) -> list[Any] | None:
    """The events' JSON values, in order, from one parse of them as an array (`fast_loads`); None when
    that cannot stand for a parse of each (one of them could hold what `json_records.loads`
    refuses, deep nesting or a lone surrogate's escape; one is not JSON): the caller then takes
    them one by one through `json_records.loads`."""
    if len(events) < 2 or any(e.count(b"[") + e.count(b"{") > json_records.MAX_DEPTH for e in events):
        return None
    joined = b",".join(events)
    if _SURROGATE_ESCAPE.search(joined):
        return None
    try:
        values = json_records.fast_loads(b"[" + joined + b"]")
    except ValueError:
        return None
    return values if len(values) == len(events) else None
