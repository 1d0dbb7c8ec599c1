"""The bodies OpenRouter answers: a chat completion (`chat_answer`), its SSE events (`sse_events`), and
its errors, before and after a provider started (`error_response`, `error_event`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from eagle3_data.dev.faults import EndpointFaults, ServerConfig
from eagle3_data.dev.text_model import Generation


def price_usd(prompt_tokens: int, completion_tokens: int, config: ServerConfig) -> float:
    price = config.price_per_token
    return round(prompt_tokens * float(price["prompt"]) + completion_tokens * float(price["completion"]), 10)


def routed_provider(routing: dict[str, Any], config: ServerConfig) -> str:
    """The display name of the provider OpenRouter would route to: the first of the pin's
    `only` or `order` slugs (by the provider table), else the server's `provider`."""
    names: dict[str, str] = {p["slug"]: p["name"] for p in config.providers}
    for slug in routing.get("only") or routing.get("order") or []:
        if slug.split("/")[0] in names:
            return names[slug.split("/")[0]]
    return config.provider


def chat_answer(
    gen: Generation,
    prompt_tokens: int,
    config: ServerConfig,
    rewrites: set[str],
    empty: bool,
    provider: str,
    faults: EndpointFaults,
) -> dict[str, Any]:
    reasoning, content, calls = (
        gen.reasoning,
        gen.content,
        [dict(c, function=dict(c["function"])) for c in gen.tool_calls],
    )
    if "trim_whitespace" in rewrites:
        reasoning = reasoning.strip() if reasoning else reasoning
        content = content.strip()
    if "rewrite_tool_call_ids" in rewrites:
        for c in calls:
            c["id"] = "call_" + uuid.uuid5(uuid.NAMESPACE_OID, c["id"] + c["function"]["arguments"]).hex[:24]
    if "reserialize_arguments" in rewrites:
        for c in calls:
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
    if "object_arguments" in rewrites:
        for c in calls:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if empty:
        reasoning, content, calls = None, "", []
    finish = "length" if gen.finish_reason == "length" else ("tool_calls" if calls else "stop")
    completion = len(gen.output_ids)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "reasoning": reasoning or None}
    if reasoning and "encrypted_reasoning" in rewrites:
        message["reasoning"] = None
        message["reasoning_details"] = [
            {"type": "reasoning.encrypted", "data": uuid.uuid4().hex * 4, "id": None, "format": "unknown", "index": 0}
        ]
    elif reasoning and "reasoning_details_only" in rewrites:
        message["reasoning"] = None
        half = len(reasoning) // 2  # two entries, listed out of order: the reader orders by index
        message["reasoning_details"] = [
            {"type": "reasoning.text", "text": reasoning[half:], "signature": None, "format": "unknown", "index": 1},
            {"type": "reasoning.text", "text": reasoning[:half], "signature": None, "format": "unknown", "index": 0},
        ]
    if calls:
        message["tool_calls"] = calls
    answer: dict[str, Any] = {
        "id": "gen-" + uuid.uuid4().hex[:24],
        "provider": faults.other_provider if "wrong_provider" in rewrites else provider,
        "model": faults.other_model
        if "wrong_model" in rewrites
        else (config.canonical_slug if config.answer_canonical_slug else config.model),
        "object": "chat.completion",
        "created": int(time.time()),
        "choices": [
            {"index": 0, "logprobs": None, "finish_reason": finish, "native_finish_reason": finish, "message": message}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "cost": price_usd(prompt_tokens, completion, config),
            "is_byok": False,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
            "cost_details": {
                "upstream_inference_prompt_cost": price_usd(prompt_tokens, 0, config),
                "upstream_inference_completions_cost": price_usd(0, completion, config),
            },
        },
    }
    if "omit_cost" in rewrites:
        del answer["usage"]["cost"]
    return answer


def sse_events(answer: dict[str, Any]) -> list[bytes]:
    """A non-streamed answer as OpenRouter's SSE events: a role chunk, the reasoning, content and
    tool-call deltas in pieces (each call's id and name first, its arguments after), a last chunk
    with the finish reason (and, for a provider failing mid-generation, the `error`), a usage
    chunk with no choices, then `data: [DONE]`."""
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "provider", "model", "object", "created")} | {
        "object": "chat.completion.chunk"
    }

    # json.dumps(dict(head, choices=[...])) of every event, with the head serialised once: the
    # same bytes at a fraction of the server's CPU per answer (~60 events)
    prefix = ("data: " + json.dumps(head)[:-1] + ', "choices": [{"index": 0, "delta": ').encode()
    suffix = b', "finish_reason": null, "native_finish_reason": null, "logprobs": null}]}\n\n'

    def event(delta: dict[str, Any] | None = None) -> bytes:
        return prefix + json.dumps(delta or {}).encode() + suffix

    def pieces(text: str, size: int = 7) -> list[str]:
        return [text[i : i + size] for i in range(0, len(text), size)]

    events = [event({"role": "assistant", "content": ""})]
    events += [
        event({"role": "assistant", "content": "", "reasoning": t}) for t in pieces(message.get("reasoning") or "")
    ]
    for d in message.get("reasoning_details") or ():
        events.append(event({"role": "assistant", "content": "", "reasoning_details": [d]}))
    events += [event({"role": "assistant", "content": t}) for t in pieces(message.get("content") or "")]
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn, args = call["function"], call["function"]["arguments"]
        events.append(
            event(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ],
                }
            )
        )
        parts = pieces(args) if isinstance(args, str) else [args]
        events += [
            event({"role": "assistant", "content": None, "tool_calls": [{"index": i, "function": {"arguments": part}}]})
            for part in parts
        ]
    last = json.loads(event()[6:])
    last["choices"][0].update(
        finish_reason=choice["finish_reason"], native_finish_reason=choice["native_finish_reason"]
    )
    if choice.get("error"):
        last["error"] = choice["error"]
    events.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    events.append(b"data: " + json.dumps(dict(head, choices=[], usage=answer["usage"])).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def error_event(generation_id: str, error: dict[str, Any]) -> dict[str, Any]:
    """OpenRouter's SSE data event for an error after the stream opened (errors-and-debugging:
    "Error During Streaming"): the error, and the choice finished with `error`."""
    return {
        "id": generation_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "error": error,
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
    }


def cut_mid_generation(answer: dict[str, Any], provider: str) -> None:
    """OpenRouter's non-streaming shape for a provider that failed after generation started:
    the partial text, `finish_reason: "error"` and the error inside the choice (billed)."""
    choice = answer["choices"][0]
    message = choice["message"]
    message["content"] = (message.get("content") or "")[: len(message.get("content") or "") // 2]
    message.pop("tool_calls", None)
    choice.update(
        finish_reason="error",
        native_finish_reason="error",
        error={
            "code": 502,
            "message": "Provider disconnected mid-stream",
            "metadata": {"error_type": "provider_unavailable", "provider_name": provider},
        },
    )


def openrouter_error(
    code: int,
    message: str,
    headers: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    status: int | None = None,
) -> JSONResponse:
    """OpenRouter's error body; `status` differs from `code` only for errors raised once a
    provider had started (HTTP 200, the error in the body)."""
    return JSONResponse(
        {"error": {"code": code, "message": message, "metadata": metadata or {}}, "user_id": "user_dev"},
        status_code=status or code,
        headers=headers,
    )


def error_response(error: str, faults: EndpointFaults, provider: str = "", model: str = "") -> Response:
    """The bodies OpenRouter answers (errors-and-debugging.mdx; bodies recorded from the service)."""
    if error == "rate_limit":
        return openrouter_error(
            429,
            "Rate limit exceeded (injected)",
            {"Retry-After": str(faults.retry_after_s)},
            {"error_type": "rate_limit_exceeded"},
        )
    if error == "credits":
        return openrouter_error(
            402,
            "Insufficient credits. Add more using https://openrouter.ai/credits (injected)",
            metadata={"error_type": "payment_required"},
        )
    if error == "in_flight_402":
        hint = str(faults.retry_after_s)
        return openrouter_error(
            402,
            "This request would exceed your available credits given your current in-flight requests. Retry "
            "after in-flight requests settle, or add credits.",
            {"Retry-After": hint},
            {
                "reason": "in_flight_budget_exhausted",
                "limit_source": "openrouter_in_flight_budget",
                "remedy_hint": "Retry after your in-flight requests settle (see the Retry-After header).",
                "headers": {"Retry-After": hint},
            },
        )
    if error == "forbidden":
        return openrouter_error(
            403, "Key limit exceeded (total limit). Manage it using https://openrouter.ai/settings/keys"
        )
    if error == "moderation":
        return openrouter_error(
            403,
            f'{model} requires moderation on {provider}. Your input was flagged for "harassment"',
            metadata={
                "reasons": ["harassment"],
                "flagged_input": "...",
                "provider_name": provider,
                "model_slug": model,
            },
        )
    if error == "bad_request":
        return openrouter_error(400, "Provider rejected the request (injected)")
    if error == "server_error":
        return openrouter_error(502, "Provider returned error (injected)", metadata={"provider_name": provider})
    if error == "error_in_body":
        return openrouter_error(
            502,
            "Provider returned error",
            metadata={"provider_name": provider, "raw": "upstream connection reset (injected)"},
            status=200,
        )
    return openrouter_error(500, f"unknown fault {error}")
