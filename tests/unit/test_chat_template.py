"""Our Kimi-K2.5 chat template renders exactly like Moonshot's on hundreds of conversations."""

from __future__ import annotations

import json
import random

import pytest

NAMES = ["get_weather", "search", "run_python", "lookup.v2"]
TEXTS = ["Hi", "", " spaced  ", "多语言 текст 😀", "line1\nline2", '<b>x</b> {"a": 1}', "None"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": f"call {n}",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "description": "é 中"}},
                "required": ["q"],
            },
        },
    }
    for n in NAMES
]


def _content(rng: random.Random):
    kind = rng.random()
    if kind < 0.6:
        return rng.choice(TEXTS)
    if kind < 0.7:
        return None
    parts = []
    for _ in range(rng.randint(1, 3)):
        t = rng.choice(["text", "text", "image_url", "image", "video_url"])
        parts.append({"type": t, "text": rng.choice(TEXTS)} if t == "text" else {"type": t, t: {"url": "x"}})
    return parts


def _conversation(rng: random.Random) -> tuple[list[dict], dict]:
    messages: list[dict] = []
    calls = 0
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(TEXTS + ["You are Kimi."])})
    for _ in range(rng.randint(1, 4)):
        user = {"role": "user", "content": _content(rng)}
        if rng.random() < 0.2:
            user["name"] = rng.choice(["alice", "bob"])
        messages.append(user)
        for _ in range(rng.randint(0, 2)):
            msg: dict = {"role": "assistant", "content": _content(rng)}
            if rng.random() < 0.6:
                msg["reasoning_content"] = rng.choice(TEXTS[:-1] + ["Let me think step by step."])
            if rng.random() < 0.15:
                msg["name"] = "kimi"
            if rng.random() < 0.5:
                msg["tool_calls"] = []
                for _ in range(rng.randint(1, 3)):
                    name = rng.choice(NAMES)
                    args = {"q": rng.choice(TEXTS), "n": rng.randint(0, 9)}
                    msg["tool_calls"].append(
                        {
                            "id": f"functions.{name}:{calls}",
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args) if rng.random() < 0.5 else args},
                        }
                    )
                    calls += 1
                messages.append(msg)
                for call in msg["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": _content(rng)})
            else:
                messages.append(msg)
    kwargs: dict = {"add_generation_prompt": rng.random() < 0.5}
    if rng.random() < 0.4:
        kwargs["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    thinking = rng.choice(["undefined", True, False])
    if thinking != "undefined":
        kwargs["thinking"] = thinking
    return messages, kwargs


def test_ours_renders_like_moonshots_on_many_conversations(kimi_tokenizer, reference_chat_template):
    if reference_chat_template is None:
        pytest.skip("../shared/kimi-k2.5/chat_template.jinja not present")
    rng = random.Random(20261129)
    seen = {"tool": 0, "dropped_reasoning": 0, "kept_reasoning": 0, "list_content": 0}
    for case in range(400):
        messages, kwargs = _conversation(rng)
        ours = kimi_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        ref = kimi_tokenizer.apply_chat_template(
            messages, tokenize=False, chat_template=reference_chat_template, **kwargs
        )
        assert ours == ref, f"case {case}: {json.dumps(messages, ensure_ascii=False)} {kwargs}"
        seen["tool"] += any(m["role"] == "tool" for m in messages)
        seen["list_content"] += any(isinstance(m.get("content"), list) for m in messages)
        for m in messages:
            rc = m.get("reasoning_content")
            if rc and m["role"] == "assistant" and kwargs.get("thinking", True) is not False:
                seen["kept_reasoning" if f"<think>{rc}</think>" in ours else "dropped_reasoning"] += 1
    # The random mix must actually cover the features it claims to.
    assert all(v >= 20 for v in seen.values()), seen


def test_reasoning_dropped_before_last_plain_assistant_turn_and_kept_after(kimi_tokenizer):
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "OLD"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "NEW",
            "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
    ]
    text = kimi_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_user|>user<|im_middle|>q1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>"
        "<|im_user|>user<|im_middle|>q2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>NEW</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:0\n42<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    off = kimi_tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, thinking=False)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
