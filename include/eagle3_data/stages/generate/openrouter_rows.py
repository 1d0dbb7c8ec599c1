"""What the overflow client sends and what it stores: the request body and the generation row of an answer.

The history goes to OpenRouter in its documented fields. An earlier assistant turn's reasoning
is sent as `reasoning` (the plain text OpenRouter documents on assistant messages, beside
`reasoning_details`), never as `reasoning_content` (the chat template's name for it, which
OpenRouter does not document: a provider that drops it answers a prompt without that reasoning
while our prompt ids hold it; the prompt-billing check of the gate would then fail the dataset).
`reasoning_details` is not sent: the rows keep the reasoning text (what the prompt ids are made
of), not the provider's detail objects, and sending both could render the reasoning twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_data.images import data_uri, image_parts
from eagle3_data.schemas import IDENTITY_MISMATCH
from eagle3_data.stages.generate.checkpoint import Prompt, generation_row, sampling_for
from eagle3_data.stages.generate.contracts import GenerationRow
from eagle3_data.stages.generate.provider_answers import describe, error_of, read_message
from eagle3_data.stages.generate.provider_identity import Pin

SOURCE = "openrouter"
# The config's sampling keys (SGLang's names) -> OpenRouter chat-completion fields; the generation
# mode is not among them: it is bound into the output format (and sent as `reasoning`).
REQUEST_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
    "seed": "seed",
    "sampling_seed": "seed",
}


def request_sampling(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """OpenRouter's fields for the config's sampling params. `top_k` -1 (SGLang's "whole
    vocabulary") is OpenRouter's 0 ("disabled")."""
    out = {REQUEST_FIELDS[k]: v for k, v in sampling.items() if v is not None}
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


def provider_messages(messages: list[dict[str, Any]], image_urls: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The history in OpenRouter's documented fields: an assistant turn's `reasoning_content` sent
    as `reasoning`, each image part's url (the stored object's s3:// URI, which no provider can
    read) replaced by `image_urls` in order (data URIs of the objects); the others as they are."""
    if image_urls:
        messages = json.loads(json.dumps(messages))  # the prompt's own messages stay as they are
        for (i, j, _), url in zip(image_parts(messages), image_urls, strict=True):
            messages[i]["content"][j] = {"type": "image_url", "image_url": {"url": url}}
    if not any("reasoning_content" in m for m in messages):
        return messages
    return [
        {**{k: v for k, v in m.items() if k != "reasoning_content"}, "reasoning": m["reasoning_content"]}
        if "reasoning_content" in m
        else m
        for m in messages
    ]


@dataclass(frozen=True)
class RequestShape:
    """What every request of the stage carries besides its prompt."""

    model: str
    provider: Mapping[str, Any]
    reasoning: Mapping[str, Any]
    sampling: Mapping[str, Any]
    stream: bool
    image_bytes: Callable[[dict[str, Any]], bytes] | None = (
        None  # an image reference's verified bytes (images.read_image)
    )

    def body(self, p: Prompt) -> dict[str, Any]:
        urls = [data_uri(self.image_bytes(ref)) for ref in p.images] if p.images_json and self.image_bytes else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": provider_messages(p.messages, urls),
            "reasoning": dict(self.reasoning),
            "provider": dict(self.provider),
            "usage": {"include": True},
        }
        if self.stream:  # usage in the last chunk: OpenRouter always sends it (`stream_options` is a deprecated
            # no-op there), an OpenAI-compatible server (vLLM) only when asked
            body.update(stream=True, stream_options={"include_usage": True})
        if p.tools:
            body["tools"] = p.tools
        body.update(request_sampling(sampling_for(p, dict(self.sampling))))
        return body


@dataclass(frozen=True)
class RowContext:
    """What a row records of the stage: the request, the tokenizer and the identity pin."""

    model: str
    provider: Mapping[str, Any]
    sampling: Mapping[str, Any]
    thinking: bool
    tokenizer_sha256: str | None
    pin: Pin | None


def lost_provenance(lost: list[dict[str, Any]]) -> dict[str, Any]:
    """Provenance of the attempts a sample lost before its row (cut streams, unreadable answers,
    timed-out requests), each priced: they are paid money the row accounts for."""
    if not lost:
        return {}
    return {"lost_attempts": lost, "lost_cost_usd": round(sum(a.get("cost_usd") or 0.0 for a in lost), 10)}


def failed_with(row: GenerationRow, lost: list[dict[str, Any]]) -> GenerationRow:
    """A failed row (checkpoint.generation_row) with the sample's lost attempts in its provenance."""
    if lost:
        row["provenance"] = json.dumps(lost_provenance(lost), sort_keys=True)
    return row


def answer_row(
    p: Prompt,
    prompt_ids: list[int],
    data: Mapping[str, Any],
    cost: float | None,
    cost_source: str | None,
    ctx: RowContext,
    lost: list[dict[str, Any]],
) -> GenerationRow:
    """The row of a paid answer: ok, or why it cannot be used (final either way)."""
    row = generation_row(p, prompt_ids, SOURCE)
    reported = data.get("usage")
    usage: Mapping[str, Any] = reported if isinstance(reported, dict) else {}
    details: Mapping[str, Any] = usage.get("completion_tokens_details") or {}
    row["usage"] = {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "reasoning_tokens": details.get("reasoning_tokens"),
        "cost_usd": cost,
    }
    choices = data.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    text = read_message(choice.get("message") or {}) if choice else None
    provenance = {
        "model": data.get("model") or ctx.model,
        "provider": data.get("provider"),
        "generation_id": data.get("id"),
        "requested_provider": dict(ctx.provider),
        "sampling": sampling_for(p, dict(ctx.sampling)),
        "thinking": ctx.thinking,
        "tokenizer_sha256": ctx.tokenizer_sha256,
        "generated_at": time.time(),
        "cost_source": cost_source,
        **({"source_id": p.source_id} if p.source_id is not None else {}),
        **({"rewritten": list(text.rewritten)} if text and text.rewritten else {}),
        **lost_provenance(lost),
    }
    row["provenance"] = json.dumps(provenance, sort_keys=True)
    if not choice:
        row["status"] = "failed"
        row["error"] = "malformed answer: no choices"
        return row
    assert text is not None  # read from the choice
    finish = choice.get("finish_reason")
    row["reasoning"] = text.reasoning
    row["content"] = text.content
    row["finish_reason"] = finish
    row["tool_calls"] = json.dumps(text.tool_calls, ensure_ascii=False) if text.tool_calls else None
    if ctx.pin is not None and (why := ctx.pin.mismatch(data.get("model"), data.get("provider"))):
        row["status"] = IDENTITY_MISMATCH
        row["error"] = f"identity: {why}"
    elif finish == "error" or choice.get("error"):
        row["status"] = "failed"
        row["error"] = (
            f"{describe(error_of(choice) or {'message': 'finish_reason error'})} "
            "(mid-generation; the partial answer was billed)"
        )
    elif finish not in ("stop", "length", "tool_calls"):
        row["status"] = "failed"
        row["error"] = f"finish_reason {finish!r}"
    elif text.problem:
        row["status"] = "failed"
        row["error"] = text.problem
    elif text.unreconstructable:
        row["status"] = "unreconstructable"
        row["error"] = f"unreconstructable: {text.unreconstructable}"
    elif finish != "length" and not (text.content or "").strip() and not text.tool_calls:
        row["status"] = "failed"
        row["error"] = "empty answer: no content and no tool calls"
    return row
