"""The layouts prompt datasets come in, mapped to OpenAI chat `messages` before validation.

A row is one of (the first key found decides):
- `messages`: OpenAI chat messages (`tool_calls` on assistant turns, `role: tool` results with
  `tool_call_id`), as they are;
- `conversations`: ShareGPT turns `{"from", "value"}` with `from` one of human/user, gpt/assistant,
  system, function_call (the assistant's call: `{"name", "arguments"}` or a list of them for
  parallel calls) and observation/tool/function_response (a call's result); LLaMA-Factory's
  top-level `system` string and `tools` (a JSON string of bare function definitions) too;
- `prompt`: one user message as a plain string (with an optional `system` string).

Images: OpenAI rows carry `image_url` parts (prompts._content); ShareGPT rows (LLaVA,
LLaMA-Factory) a top-level `images` list of urls/paths, each `<image>` marker in a user turn's value
taking the next one: the turn becomes text and `image_url` parts, in the value's order.

ShareGPT records no call ids: each call gets `call_{k}` (k counts the calls of the conversation
from 0) and the results that follow take the pending calls' ids in order, so a parallel call's
results pair with its calls as the dataset lists them. The loader then rewrites every call id to
the model's own (prompts.load_prompts, `generation.call_ids`), these included, each tool
message re-keyed to the call it answers (`conversations.pair_results`).

A row that breaks its layout is refused naming the layout's own field (`conversations[3].from`),
so the owner finds it in the file.
"""

from __future__ import annotations

import json
from typing import Any

from eagle3_data import json_records

LAYOUT_KEYS = ("messages", "conversations", "prompt")  # in the order a row is tried
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "function_call",
    "observation": "tool",
    "tool": "tool",
    "function_response": "tool",
    "function": "tool",
}


class LayoutRefused(Exception):
    """A refused row: `field` in its layout's own terms (empty: the whole row), and why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def layout_of(record: dict[str, Any]) -> str:
    """Which layout the row is in (`LAYOUT_KEYS`), refusing a row in none."""
    for key in LAYOUT_KEYS:
        if record.get(key) is not None:
            return key
    raise LayoutRefused("messages", "missing (a row holds messages, conversations (ShareGPT) or prompt)")


def to_messages(record: dict[str, Any]) -> tuple[Any, Any, set[str]]:
    """(messages, tools, the keys the layout used) of a row; `messages` and `tools` still to be
    validated by the caller (prompts._normalise) like any OpenAI row."""
    layout = layout_of(record)
    if layout == "messages":
        return record["messages"], record.get("tools"), {"messages", "tools"}
    if layout == "prompt":
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise LayoutRefused("prompt", f"expected a string, got {type(prompt).__name__}")
        return (
            _system(record) + [{"role": "user", "content": prompt}],
            record.get("tools"),
            {"prompt", "system", "tools"},
        )
    return _sharegpt(record), _bare_tools(record.get("tools")), {"conversations", "system", "tools", "images"}


def _system(record: dict[str, Any]) -> list[dict[str, Any]]:
    system = record.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise LayoutRefused("system", f"expected a string, got {type(system).__name__}")
    return [{"role": "system", "content": system}]


def _sharegpt(record: dict[str, Any]) -> list[dict[str, Any]]:
    turns = record["conversations"]
    if isinstance(turns, str):  # Parquet files often hold the list as a JSON string
        turns = loads_field(turns, "conversations")
    if not isinstance(turns, list):
        raise LayoutRefused("conversations", f"expected a list, got {type(turns).__name__}")
    messages, pending, calls = _system(record), [], 0
    images = _sharegpt_images(record.get("images"))
    markers = 0
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise LayoutRefused(where, f"expected an object, got {type(turn).__name__}")
        role = SHAREGPT_ROLES.get(str(turn.get("from")).lower())
        if role is None:
            raise LayoutRefused(f"{where}.from", f"{turn.get('from')!r} is not one of {', '.join(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise LayoutRefused(f"{where}.value", f"expected a string, got {type(value).__name__}")
        if role == "function_call":
            new = [_call(c, f"{where}.value", calls + k) for k, c in enumerate(_calls_in(value, f"{where}.value"))]
            calls += len(new)
            pending += [c["id"] for c in new]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                last["tool_calls"] = new  # text then calls: one assistant turn, as the model wrote it
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": new})
        elif role == "tool":
            if not pending:
                raise LayoutRefused(f"{where}.from", f"a {turn['from']!r} result with no function_call before it")
            messages.append({"role": "tool", "tool_call_id": pending.pop(0), "content": value})
        else:
            if role == "user":
                pending.clear()  # calls left without results: the template renders them as they are
            content: str | list[dict[str, Any]] = value
            if role == "user" and IMAGE_MARKER in value:
                content, markers = (
                    _with_images(value, images, markers, f"{where}.value"),
                    markers + value.count(IMAGE_MARKER),
                )
            messages.append({"role": role, "content": content})
    if markers != len(images):
        raise LayoutRefused(
            "images", f"{len(images)} image(s) for {markers} {IMAGE_MARKER} marker(s) in the user turns"
        )
    return messages


IMAGE_MARKER = "<image>"


def _sharegpt_images(images: Any) -> list[str]:
    if images is None:
        return []
    if isinstance(images, str):
        images = loads_field(images, "images")
    if not isinstance(images, list) or not all(isinstance(u, str) and u for u in images):
        raise LayoutRefused("images", "expected a list of image urls or paths")
    return images


def _with_images(value: str, images: list[str], used: int, where: str) -> list[dict[str, Any]]:
    """A user turn's value as text and image_url parts, each `<image>` taking the next image."""
    parts: list[dict[str, Any]] = []
    for k, text in enumerate(value.split(IMAGE_MARKER)):
        if k:
            if used >= len(images):
                raise LayoutRefused(where, f"more {IMAGE_MARKER} markers than the row's {len(images)} image(s)")
            parts.append({"type": "image_url", "image_url": {"url": images[used]}})
            used += 1
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _calls_in(value: str, where: str) -> list[Any]:
    parsed = loads_field(value, where, f"a function_call that is not JSON: {value[:80]!r}")
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        raise LayoutRefused(where, "a function_call with no call")
    return calls


def _call(c: Any, where: str, k: int) -> dict[str, Any]:
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
        raise LayoutRefused(f"{where}.name", "missing or not a string")
    args = c.get("arguments", {})
    if isinstance(args, str):
        args = loads_field(args, f"{where}.arguments", f"not valid JSON: {args[:80]!r}")
    if not isinstance(args, dict):
        raise LayoutRefused(f"{where}.arguments", f"must be a JSON object, got {type(args).__name__}")
    return {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": c["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _bare_tools(tools: Any) -> Any:
    """LLaMA-Factory's `tools`: a JSON string of bare function definitions; wrapped as OpenAI's
    `{"type": "function", "function": ...}` (already wrapped ones are kept)."""
    if isinstance(tools, str):
        if not tools.strip():
            return None
        tools = loads_field(tools, "tools")
    if not isinstance(tools, list):
        return tools  # the caller refuses it with its type
    return [
        {"type": "function", "function": t} if isinstance(t, dict) and "type" not in t and "name" in t else t
        for t in tools
    ]


def loads_field(text: str, where: str, invalid: str = "a string that is not JSON") -> Any:
    """JSON held in a string field, parsed like a line (json_records: nesting depth, surrogates)."""
    try:
        return json_records.loads(text)
    except json_records.JsonRefused as exc:
        raise LayoutRefused(json_records.join_field(where, exc.field), exc.reason) from None
    except ValueError:
        raise LayoutRefused(where, invalid) from None
