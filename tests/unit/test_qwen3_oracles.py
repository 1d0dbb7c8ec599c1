"""Oracles from outside: transformers' render of Qwen3's published template (prompts, histories,
tools, tool results) against our render; vLLM's `qwen3` reasoning and `hermes` tool parsers
against our provider view."""

from __future__ import annotations

import json

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
    },
]
PARIS = ToolCall(id="call_0", name="get_weather", arguments='{"city": "Paris"}')
ROME = ToolCall(id="call_1", name="get_time", arguments='{"zone": "Europe/Rome", "note": "été ✓"}')
ANSWERS = [
    AssistantMessage(reasoning="Short.", content="The answer is 42."),
    AssistantMessage(reasoning="Two calls.", content="Let me check.", tool_calls=[PARIS, ROME]),
    AssistantMessage(reasoning="Just call.", content=None, tool_calls=[PARIS]),
    AssistantMessage(reasoning="Multi\nline\n\nreasoning.", content="Use a literal <think> tag like this."),
]


def _template_answer(tokenizer, message: AssistantMessage, thinking: bool) -> str:
    """The template's own rendering of `message` as the conversation's last assistant turn,
    minus the prompt before it: what the model is trained to generate."""
    history = [{"role": "user", "content": "q"}]
    prompt = tokenizer.apply_chat_template(
        history, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    turn = message.to_openai()
    turn["content"] = turn["content"] or ""  # the template reads content as a string
    for call in turn.get("tool_calls", []):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    full = tokenizer.apply_chat_template(history + [turn], tools=TOOLS, tokenize=False, enable_thinking=thinking)
    head = prompt if thinking else prompt.removesuffix("<think>\n\n</think>\n\n")
    assert full.startswith(head)
    return full[len(head) :].removesuffix("\n")


@pytest.mark.parametrize("index", range(len(ANSWERS)))
def test_render_equals_the_published_template(qwen3_fmt, qwen3_tokenizer, index):
    message = ANSWERS[index]
    assert qwen3_fmt.render(message, "stop") == _template_answer(qwen3_tokenizer, message, True)


def test_render_thinking_off_equals_the_template(qwen3_fmt_off, qwen3_tokenizer):
    message = AssistantMessage(content="Let me check.", tool_calls=[PARIS])
    # the template writes an empty think block into an answer turn; the prompt already holds it
    expected = _template_answer(qwen3_tokenizer, message, False).removeprefix("<think>\n\n</think>\n\n")
    assert qwen3_fmt_off.render(message, "stop") == expected


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and the time in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "dropped: before the last real query",
        "tool_calls": [PARIS.to_openai(), ROME.to_openai()],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
    {"role": "assistant", "content": "Sunny, 10:00.", "reasoning_content": "kept? no: a new query follows"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_generation_prompt_is_the_templates(qwen3_tokenizer, qwen3_fmt, qwen3_fmt_off, thinking, tools):
    fmt = qwen3_fmt if thinking else qwen3_fmt_off
    rendered = qwen3_tokenizer.apply_chat_template(
        HISTORY, tools=tools, add_generation_prompt=True, tokenize=True, enable_thinking=thinking
    )
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered  # transformers 5: BatchEncoding
    assert fmt.generation_prompt_ids(HISTORY, tools) == list(ids)
    text = qwen3_tokenizer.decode(ids)
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n10:00\n</tool_response>" in text
    assert "dropped: before" not in text and "kept? no" not in text
    assert ("<tools>" in text) == bool(tools)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
COMPACT_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone":"UTC"}}\n</tool_call>'
GENERATIONS = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 42.", True, None),
    (f"<think>\nr\n</think>\n\nCalling.\n{CALL}\n{CALL.replace('Paris', 'Rome')}", True, TOOLS),
    (f"<think>\nr\n</think>\n\n{CALL}", True, TOOLS),
    ("<think>\nr\n</think>\n\n" + COMPACT_CALL, True, TOOLS),
    (f"<think>\nr\n</think>\n\n{CALL}\ntrailing text", True, TOOLS),
    (f"<think>\nr\n</think>\n\n{CALL}", True, []),
    ("<think>\nr\n</think>\n\n<tool_call>\n{not json}\n</tool_call>", True, TOOLS),
    (f"<think>\nreasoning then a call\n{CALL}", True, TOOLS),
    ("<think>\nr\n</think>\n\nliteral <think> in content", True, None),
    ("<think>\nr <think> again\n</think>\n\nx </think> y", True, None),
    ("no opening tag\n</think>\n\nx", True, None),
    ("<think>\ncut in the reasoning", True, None),
    ("Plain <think>answer</think> with thinking off.", False, None),
    (f"Thinking off.\n{CALL}", False, TOOLS),
]


@pytest.mark.parametrize(("text", "thinking", "tools"), GENERATIONS)
def test_provider_view_equals_vllm(vllm_qwen3_oracle, qwen3_fmt, qwen3_fmt_off, text, thinking, tools):
    fmt = qwen3_fmt if thinking else qwen3_fmt_off
    view = fmt.provider_view(fmt.codec.encode_batch([text])[0], "stop", tools)
    vllm = vllm_qwen3_oracle.parse(text, thinking=thinking, tools=tools)
    assert view.message["reasoning_content"] == vllm["reasoning"]
    assert (view.message["content"] or None) == vllm["content"]
    ours = [c["function"] for c in view.message.get("tool_calls", [])]
    assert ours == vllm["calls"]
