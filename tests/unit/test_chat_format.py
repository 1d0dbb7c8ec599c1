"""The Kimi-K2 output format with the real Kimi tokenizer: render, parse, round trips."""

from __future__ import annotations

import json

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall, get_output_format
from eagle3_data.errors import UserError

REFERENCE_TEXT = "Let me think.</think>The answer is 42.<|im_end|>"
REFERENCE_IDS = [9413, 1019, 2704, 13, 163607, 1008, 7574, 387, 220, 5512, 13, 163586]


@pytest.fixture(scope="module")
def fmt(kimi_tokenizer):
    return get_output_format(kimi_tokenizer)


def _ids(fmt, text: str) -> list[int]:
    return fmt.codec.encode_batch([text])[0]


def test_special_ids_derived_by_name(fmt):
    assert fmt.name == "kimi_k2"
    assert fmt.stop_token_ids == [163586, 163585]
    assert fmt.special_ids["<|im_end|>"] == 163586
    assert fmt.special_ids["</think>"] == 163607
    assert fmt.special_ids["<|tool_call_begin|>"] == 163597
    assert 163533 not in fmt.special_ids.values()


def test_kimi_pattern_is_moonshots():
    import splintr

    from eagle3_data.chat_format.kimi_k2 import KIMI_PATTERN

    assert KIMI_PATTERN == splintr.KIMI_PATTERN


def test_render_reference(fmt):
    msg = AssistantMessage(reasoning="Let me think.", content="The answer is 42.")
    text = fmt.render(msg)
    assert text == REFERENCE_TEXT
    assert _ids(fmt, text) == REFERENCE_IDS


def test_render_tool_calls_rederives_provider_ids(fmt):
    msg = AssistantMessage(
        reasoning="",
        content="",
        tool_calls=[
            ToolCall.from_openai({"id": "call_abc", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}),
            ToolCall.from_openai({"id": "call_def", "function": {"name": "search", "arguments": {"q": "é"}}}),
        ],
    )
    assert fmt.render(msg, "tool_calls", tool_call_index_start=2) == (
        "</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>{"q": "é"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )


def test_render_truncated_and_thinking_off(fmt):
    assert fmt.render(AssistantMessage(reasoning="half a thou"), "length") == "half a thou"
    assert fmt.render(AssistantMessage(reasoning="r", content="par"), "length") == "r</think>par"
    assert fmt.render(AssistantMessage(content="hi"), "stop", thinking=False) == "hi<|im_end|>"
    with pytest.raises(UserError, match="thinking is off"):
        fmt.render(AssistantMessage(reasoning="r", content="hi"), thinking=False)
    with pytest.raises(UserError, match="finish_reason"):
        fmt.render(AssistantMessage(content="x"), "content_filter")


def test_parse_reference_with_and_without_stop_id(fmt):
    with_stop = fmt.parse_ids(REFERENCE_IDS)
    assert with_stop.message.reasoning == "Let me think."
    assert with_stop.message.content == "The answer is 42."
    assert with_stop.message.tool_calls == []
    assert (with_stop.finish_reason, with_stop.stop_token_id) == ("stop", 163586)
    without = fmt.parse_ids(REFERENCE_IDS[:-1], "stop")
    assert (without.message, without.finish_reason, without.stop_token_id) == (with_stop.message, "stop", None)
    truncated = fmt.parse_ids(REFERENCE_IDS[:-1])
    assert truncated.finish_reason == "length"


def test_parse_tool_section_like_sglang(fmt):
    text = (
        "I need the weather.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:4<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.lookup.v2:5<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )
    parsed = fmt.parse_ids(_ids(fmt, text))
    msg = parsed.message
    # The start of the tool section ends reasoning, as in SGLang's kimi_k2 reasoning parser.
    assert msg.reasoning == "I need the weather." and msg.reasoning_closed is False and msg.content is None
    assert [(c.id, c.name, c.arguments) for c in msg.tool_calls] == [
        ("functions.get_weather:4", "get_weather", '{"city": "Paris"}'),
        ("functions.lookup.v2:5", "lookup.v2", "{}"),
    ]
    assert parsed.tool_call_index_start == 4 and msg.tool_tail is None
    assert fmt.render(msg, parsed.finish_reason, parsed.tool_call_index_start) == text


CASES = [
    REFERENCE_TEXT,
    "</think><|im_end|>",
    "no reasoning at all<|im_end|>",
    "r</think>c<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    '{"a": "多语言 😀"}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}'
    "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
    "Thinking about <|im_end|> as text</think>And <|im_user|> here too.<|im_end|>",
    "a</think>b</think>c<|im_end|>",
    "r</think>c<|tool_calls_section_begin|>garbage<|tool_calls_section_end|><|im_end|>",
]


@pytest.mark.parametrize("text", CASES)
def test_every_prefix_round_trips(fmt, text):
    """parse -> render reproduces the ids of every truncation point: inside reasoning, content,
    a tool-call id, arguments, and the section; with and without the stop id."""
    ids = _ids(fmt, text)
    for cut in range(len(ids) + 1):
        prefix = ids[:cut]
        for finish in (None, "length", "stop"):
            parsed = fmt.parse_ids(prefix, finish)
            rendered = fmt.render(parsed.message, parsed.finish_reason, parsed.tool_call_index_start or 0)
            expect = prefix if parsed.finish_reason == "length" or parsed.stop_token_id else prefix + [163586]
            if "\ufffd" in rendered:  # cut inside a multi-byte character: text is lost (text_diff)
                with pytest.raises(UnicodeDecodeError):
                    fmt.codec.encoding.decode_bytes(prefix).decode("utf-8")
                continue
            assert _ids(fmt, rendered) == expect, (cut, finish, rendered)


def test_thinking_off_parse(fmt):
    ids = _ids(fmt, "Just an answer.<|im_end|>")
    parsed = fmt.parse_ids(ids, thinking=False)
    assert parsed.message.reasoning is None and parsed.message.content == "Just an answer."
    assert fmt.render(parsed.message, "stop", thinking=False) == "Just an answer.<|im_end|>"


def test_tool_call_index_and_generation_prompt(fmt, kimi_tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "functions.f:1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
        {"role": "tool", "tool_call_id": "functions.f:1", "content": "2"},
    ]
    assert fmt.tool_call_index_start(messages) == 2
    assert fmt.tool_call_index_start(messages[:1]) == 0
    ids = fmt.generation_prompt_ids(messages[:1])
    assert ids == [163587, 2482, 163601, 9663, 163586, 163588, 69702, 163601, 163606]
    off = fmt.generation_prompt_ids(messages[:1], thinking=False)
    assert off[-2:] == [163606, 163607]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = kimi_tokenizer.decode(fmt.generation_prompt_ids(messages, tools))
    assert with_tools.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function"')


def test_openai_message_round_trip():
    raw = {"role": "assistant", "reasoning": "r", "content": "c",
           "tool_calls": json.dumps([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])}
    msg = AssistantMessage.from_openai(raw)
    assert msg.tool_calls == [ToolCall("call_1", "f", "{}")]
    assert msg.to_openai()["reasoning_content"] == "r"


def test_tokenizer_without_a_known_format_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(UserError, match="no known output format"):
        get_output_format(tok)
