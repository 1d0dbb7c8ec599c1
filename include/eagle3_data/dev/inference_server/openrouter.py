"""OpenRouter's routes: `/v1/chat/completions` (plain or streamed), the provider table and the
generation records (`/v1/generation`) a client reads the cost from."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from eagle3_data.dev.faults import EndpointFaults
from eagle3_data.dev.inference_server.media import image_inputs, media_pad_id, without_image_data
from eagle3_data.dev.inference_server.openrouter_answers import (
    chat_answer,
    cut_mid_generation,
    error_event,
    error_response,
    openrouter_error,
    price_usd,
    routed_provider,
    sse_events,
)
from eagle3_data.dev.inference_server.state import DATASET_HEADER, SAMPLE_HEADER, ServerState
from eagle3_data.images import expand_media


def add_routes(app: FastAPI, state: ServerState) -> None:
    tok, admit, delivered, generate_cached, chat_prompt = (
        state.tok,
        state.admit,
        state.delivered,
        state.generate_cached,
        state.chat_prompt,
    )

    @app.get("/v1/providers")
    async def providers() -> dict[str, Any]:
        """OpenRouter's provider table: display names and the slugs routing takes."""
        return {
            "data": [
                dict(p, privacy_policy_url=None, terms_of_service_url=None, status_page_url=None)
                for p in state.config.providers
            ]
        }

    @app.get("/v1/generation")
    async def generation(id: str = "") -> Response:
        """OpenRouter's record of a chat generation (`total_cost` in USD); like the real one it
        answers 404 for a moment after the completion (`generation_lag` times per id, and for
        `record_delay_s` after it was made)."""
        state.lookups[id] += 1
        record, faults = state.generations.get(id), state.config.faults("chat")
        if (
            record is None
            or state.lookups[id] <= faults.generation_lag
            or time.monotonic() < state.recorded_at.get(id, 0.0) + faults.record_delay_s
        ):
            return openrouter_error(404, "Resource not found")
        return JSONResponse({"data": record})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        """OpenRouter's chat completions, plain or streamed (`stream: true`: SSE, as `sse_events` says).
        The history is read in OpenRouter's documented fields only (`documented_history`)."""
        try:
            body = await request.json()
        except ValueError:
            return openrouter_error(400, "body is not JSON")
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return openrouter_error(400, "messages: expected a non-empty list")
        if body.get("model") not in (state.config.model, state.config.canonical_slug):
            return openrouter_error(400, f"{body.get('model')} is not a valid model ID")
        thinking = (body.get("reasoning") or {}).get("enabled", True) is not False
        injected = state.config.faults("chat").inject_system_prompt  # a provider adding its own system message
        try:
            pictures = image_inputs(messages)
        except ValueError as exc:
            return openrouter_error(400, str(exc))
        try:
            prompt = chat_prompt(
                json.dumps(
                    [
                        [{"role": "system", "content": injected}] * bool(injected)
                        + documented_history(without_image_data(messages) if pictures else messages),
                        tools,
                        thinking,
                    ]
                )
            )
            if pictures:  # the model sees (and the provider bills) each image's media tokens
                prompt = tuple(expand_media(list(prompt), pictures, media_pad_id(tok)))
        except Exception as exc:  # template errors are the client's bad request
            return openrouter_error(400, f"chat template: {exc}")
        key = request.headers.get(SAMPLE_HEADER) or str(hash(prompt))
        stream = body.get("stream") is True
        error, rewrites, faults, latency = await admit("chat", request, key, wait=not stream)
        provider = routed_provider(body.get("provider") or {}, state.config)
        if stream and error == "error_in_body":  # failed after the provider started: an SSE error event
            body = json.loads(bytes(error_response(error, faults, provider, state.config.model).body))
            event = error_event("gen-" + uuid.uuid4().hex[:24], body["error"])
            record(  # recorded, nothing billed: the provider failed before any output
                {
                    "id": event["id"],
                    "model": state.config.model,
                    "provider_name": provider,
                    "created": int(time.time()),
                },
                len(prompt),
                0,
                "error",
                cost=0.0,
            )
            return StreamingResponse(
                iter(
                    [
                        b": OPENROUTER PROCESSING\n\n",
                        b"data: " + json.dumps(event).encode() + b"\n\n",
                        b"data: [DONE]\n\n",
                    ]
                ),
                media_type="text/event-stream",
            )
        if error and error not in ("malformed_json", "empty_content", "choice_error"):
            return error_response(error, faults, provider, state.config.model)
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 4096
        if faults.cut_after_tool_result is not None and messages[-1].get("role") == "tool":
            max_new = min(int(max_new), faults.cut_after_tool_result)
        gen = generate_cached(
            prompt,
            int(max_new),
            float(body.get("temperature", 1.0)),
            body.get("seed"),
            request.headers.get(DATASET_HEADER),
        )
        answer = chat_answer(
            gen, len(prompt), state.config, rewrites, empty=error == "empty_content", provider=provider, faults=faults
        )
        if error == "choice_error":
            cut_mid_generation(answer, provider)
        # billed once the provider started, whatever the client then does; a stream that fails
        # mid-generation (`stream_error`) bills the prompt and the tokens it sent
        failing = stream and "stream_error" in rewrites
        billed = len(gen.output_ids) // 2 if failing else len(gen.output_ids)
        record(
            {
                "id": answer["id"],
                "model": answer["model"],
                "provider_name": answer["provider"],
                "created": answer["created"],
            },
            len(prompt),
            billed,
            "error" if failing else answer["choices"][0]["finish_reason"],
        )
        headers = {"X-Generation-Id": answer["id"]}
        if stream:
            return StreamingResponse(
                _stream_answer(request, key, answer, rewrites, faults, latency),
                headers=headers,
                media_type="text/event-stream",
            )
        await delivered("chat", key, request)
        if error == "malformed_json":
            return Response(
                json.dumps(answer)[: len(json.dumps(answer)) // 2], media_type="application/json", headers=headers
            )
        return JSONResponse(answer, headers=headers)

    def record(
        answer: dict[str, Any], prompt_tokens: int, completion_tokens: int, finish: str, cost: float | None = None
    ) -> None:
        """The generation's record (GET /v1/generation, the ledger `dev/stats` sums), in
        OpenRouter's fields."""
        state.generations[answer["id"]] = {
            "id": answer["id"],
            "model": answer["model"],
            "provider_name": answer["provider_name"],
            "total_cost": price_usd(prompt_tokens, completion_tokens, state.config) if cost is None else cost,
            "tokens_prompt": prompt_tokens,
            "tokens_completion": completion_tokens,
            "native_tokens_prompt": prompt_tokens,
            "native_tokens_completion": completion_tokens,
            "finish_reason": finish,
            "created_at": answer["created"],
        }
        state.recorded_at[answer["id"]] = time.monotonic()

    async def _stream_answer(
        request: Request, key: str, answer: dict[str, Any], rewrites: set[str], faults: EndpointFaults, latency: float
    ) -> AsyncIterator[bytes]:
        """The answer as OpenRouter streams it: keep-alive comments while it is prepared (the
        endpoint's latency), then `sse_events`'s events. `stream_cut` drops the connection after half of
        them, `stream_stall` goes silent for `stall_s` there; both are billed whole, as a provider
        that does not cancel on disconnect bills them."""
        state.stats.in_flight["chat"] += 1
        state.stats.max_in_flight["chat"] = max(state.stats.max_in_flight["chat"], state.stats.in_flight["chat"])
        try:
            waited = 0.0
            yield b": OPENROUTER PROCESSING\n\n"
            while waited < latency:
                step = min(faults.keepalive_s or latency, latency - waited)
                await asyncio.sleep(step)
                waited += step
                yield b": OPENROUTER PROCESSING\n\n"
            # the events in two writes, before and after the half where a fault strikes: one write per
            # event cost this one-process stand-in ~1 ms of CPU per answer (~60 ASGI sends), which
            # held the overflow benchmark's streamed rate below C/L (benchmarks/overflow_client.py); the
            # client reads the same bytes, in pieces as the socket gives them, whatever the writes
            events = sse_events(answer)
            half = len(events) // 2
            yield b"".join(events[:half])
            if "stream_cut" in rewrites:
                state.stats.faults["chat"]["stream_cut"] += 1
                state.stats.abandoned["chat"] += 1
                raise ConnectionAbortedError("stream_cut (injected)")  # the server drops the connection
            if "stream_error" in rewrites:  # OpenRouter's mid-stream error: a data event, no usage
                state.stats.faults["chat"]["stream_error"] += 1
                error = {
                    "code": 502,
                    "message": "Provider disconnected mid-stream (injected)",
                    "metadata": {"provider_name": answer["provider"]},
                }
                yield b"data: " + json.dumps(error_event(answer["id"], error)).encode() + b"\n\ndata: [DONE]\n\n"
                return
            if "stream_stall" in rewrites:
                state.stats.faults["chat"]["stream_stall"] += 1
                await asyncio.sleep(faults.stall_s)
            yield b"".join(events[half:])
            await delivered("chat", key, request)
        finally:
            state.stats.in_flight["chat"] -= 1


def documented_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as OpenRouter reads it: an assistant turn's reasoning from its documented fields,
    `reasoning` (text) or the text of its `reasoning_details`, handed to the chat template (which
    calls it `reasoning_content`); a `reasoning_content` field, which OpenRouter does not
    document, is dropped, as a provider that reads only the documented fields drops it."""
    return [_documented_turn(m) if m.get("role") == "assistant" else m for m in messages]


def _documented_turn(m: dict[str, Any]) -> dict[str, Any]:
    reasoning = m.get("reasoning")
    if reasoning is None:
        details = [d for d in m.get("reasoning_details") or () if isinstance(d, dict)]
        texts = sorted((d for d in details if d.get("type") == "reasoning.text"), key=lambda d: d.get("index") or 0)
        reasoning = "".join(d.get("text") or "" for d in texts) or None
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning", "reasoning_details")}
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    return out
