"""The Kimi-K2 output format with the real Kimi tokenizer: render, parse, round trips."""

from __future__ import annotations

import json

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall, get_output_format
from eagle3_data.errors import UserError
from tests.fixtures.kimi import CHAS, EOS, IM_END, IM_END_AS_TEXT, REFERENCE_IDS, REFERENCE_TEXT, THINK_END


@pytest.fixture(scope="module")
def fmt(kimi_fmt):
    return kimi_fmt


@pytest.fixture(scope="module")
def fmt_off(kimi_fmt_off):
    return kimi_fmt_off


def _ids(fmt, text: str) -> list[int]:
    return fmt.codec.encode_batch([text])[0]


def test_special_ids_derived_by_name(fmt):
    assert fmt.name == "kimi_k2"
    assert fmt.stop_token_ids == [IM_END, EOS]
    assert fmt.special_ids["<|im_end|>"] == IM_END
    assert fmt.special_ids["</think>"] == THINK_END
    assert fmt.special_ids["<|tool_call_begin|>"] == 163597
    assert CHAS not in fmt.special_ids.values()


def test_the_mode_is_bound_once(kimi_tokenizer, fmt, fmt_off):
    """No default: a caller cannot forget the mode. The two modes share one verified codec."""
    with pytest.raises(TypeError):
        get_output_format(kimi_tokenizer)
    with pytest.raises(TypeError):
        get_output_format(kimi_tokenizer, thinking="no")
    assert get_output_format(kimi_tokenizer, thinking=True) is fmt and fmt.thinking
    assert get_output_format(kimi_tokenizer, thinking=False) is fmt_off and not fmt_off.thinking
    assert fmt.codec is fmt_off.codec


def test_kimi_pattern_is_moonshots():
    import splintr

    from eagle3_data.chat_format.kimi_k2 import KIMI_PATTERN

    assert KIMI_PATTERN == splintr.KIMI_PATTERN


def test_render_reference(fmt):
    msg = AssistantMessage(reasoning="Let me think.", content="The answer is 42.")
    text = fmt.render(msg, "stop")
    assert text == REFERENCE_TEXT
    assert _ids(fmt, text) == REFERENCE_IDS
    assert fmt.encode_parts_batch([fmt.render_parts(msg, "stop")]) == [REFERENCE_IDS]


def test_literal_special_text_is_text(fmt):
    """Model-produced strings are encoded as ordinary text; only the structure inserts special ids."""
    msg = AssistantMessage(reasoning="r", content="Write <|im_end|> literally.")
    [ids] = fmt.encode_parts_batch([fmt.render_parts(msg, "stop")])
    assert ids.count(IM_END) == 1 and ids[-1] == IM_END  # the stop id only
    assert fmt.codec.decode(ids) == "r</think>Write <|im_end|> literally.<|im_end|>"
    assert ids[2:-1] == fmt.codec.encode_ordinary_batch(["Write <|im_end|> literally."])[0]
    assert ids[4:8] == IM_END_AS_TEXT[2:]  # " <|" merges with its space; "im_end|>" as text
    call = ToolCall("c", "f", '{"s": "<|tool_call_begin|></think>"}')
    [ids] = fmt.encode_parts_batch([fmt.render_parts(AssistantMessage("", "", [call]), "tool_calls")])
    assert ids.count(163597) == 1 and ids.count(THINK_END) == 1
    assert fmt.literal_special_text(["a <|im_end|> b", None, "</think>"]) == ["</think>", "<|im_end|>"]


def test_render_tool_calls_rederives_provider_ids(fmt):
    msg = AssistantMessage(
        reasoning="",
        content="",
        tool_calls=[
            ToolCall.from_openai(
                {"id": "call_abc", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ),
            ToolCall.from_openai({"id": "call_def", "function": {"name": "search", "arguments": {"q": "é"}}}),
        ],
    )
    assert fmt.render(msg, "tool_calls", 2) == (
        "</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>{"q": "é"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )


def test_render_truncated_and_thinking_off(fmt, fmt_off):
    assert fmt.render(AssistantMessage(reasoning="half a thou"), "length") == "half a thou"
    assert fmt.render(AssistantMessage(reasoning="r", content="par"), "length") == "r</think>par"
    assert fmt_off.render(AssistantMessage(content="hi"), "stop") == "hi<|im_end|>"
    assert fmt.render(AssistantMessage(content="hi"), "stop") == "</think>hi<|im_end|>"
    with pytest.raises(UserError, match="thinking is off"):
        fmt_off.render(AssistantMessage(reasoning="r", content="hi"), "stop")
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
            expect = prefix if parsed.finish_reason == "length" or parsed.stop_token_id else prefix + [IM_END]
            if "\ufffd" in rendered:  # cut inside a multi-byte character: text is lost (text_diff)
                with pytest.raises(UnicodeDecodeError):
                    fmt.codec.encoding.decode_bytes(prefix).decode("utf-8")
                continue
            assert _ids(fmt, rendered) == expect, (cut, finish, rendered)
            parts = fmt.render_parts(parsed.message, parsed.finish_reason, parsed.tool_call_index_start or 0)
            m = parsed.message
            # A real special id inside content (a second </think>) comes back as its name: only
            # then does the ordinary (text-is-text) encode differ from the lossless one.
            if not fmt.literal_special_text(
                [m.reasoning, m.content, m.tool_tail] + [c.arguments for c in m.tool_calls]
            ):
                assert fmt.encode_parts_batch([parts]) == [expect], (cut, finish)


def test_thinking_off_parse(fmt_off):
    ids = _ids(fmt_off, "Just an answer.<|im_end|>")
    parsed = fmt_off.parse_ids(ids)
    assert parsed.message.reasoning is None and parsed.message.content == "Just an answer."
    assert fmt_off.render(parsed.message, "stop") == "Just an answer.<|im_end|>"


def test_tool_call_index_and_generation_prompt(fmt, fmt_off, kimi_tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "functions.f:1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
        {"role": "tool", "tool_call_id": "functions.f:1", "content": "2"},
    ]
    assert fmt.tool_call_index_start(messages) == 2
    assert fmt.tool_call_index_start(messages[:1]) == 0
    ids = fmt.generation_prompt_ids(messages[:1])
    assert ids == [163587, 2482, 163601, 9663, IM_END, 163588, 69702, 163601, 163606]
    off = fmt_off.generation_prompt_ids(messages[:1])
    assert off[-2:] == [163606, THINK_END]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = kimi_tokenizer.decode(fmt.generation_prompt_ids(messages, tools))
    assert with_tools.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function"')


def test_openai_message_round_trip():
    raw = {
        "role": "assistant",
        "reasoning": "r",
        "content": "c",
        "tool_calls": json.dumps([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    }
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
        get_output_format(tok, thinking=True)
