"""Qwen3Format: detection, render, the lossless parse, the provider view's notes."""

from __future__ import annotations

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall, find_output_format
from eagle3_data.chat_format.qwen3 import Qwen3Format
from eagle3_data.errors import UserError
from tests.fixtures.qwen3 import CALL_BEGIN, CALL_END, ENDOFTEXT, IM_END, THINK, THINK_END

CALL = ToolCall(id="call_0", name="get_weather", arguments='{"city": "Paris"}')
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_detection_tells_qwen_from_kimi(qwen3_tokenizer, kimi_tokenizer):
    assert find_output_format(qwen3_tokenizer) is Qwen3Format
    assert not Qwen3Format.matches(kimi_tokenizer)
    kimi = find_output_format(kimi_tokenizer)
    assert kimi is not None and kimi.name == "kimi_k2"
    with pytest.raises(UserError, match="model.family is 'kimi_k2' but .* 'qwen3'"):  # a named family must match
        find_output_format(qwen3_tokenizer, "kimi_k2")


def test_ids_come_from_the_tokenizer_and_equal_the_published_ones(qwen3_fmt):
    assert qwen3_fmt.stop_token_ids == [IM_END, ENDOFTEXT]
    assert qwen3_fmt.reasoning_end_id == THINK_END and qwen3_fmt.tool_section_id == CALL_BEGIN
    assert {n: qwen3_fmt.special_ids[n] for n in Qwen3Format.reference_ids if n in qwen3_fmt.special_ids} == {
        n: i for n, i in Qwen3Format.reference_ids.items() if n in qwen3_fmt.special_ids
    }


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (AssistantMessage(reasoning="Let me think.", content="42"), "<think>\nLet me think.\n</think>\n\n42<|im_end|>"),
        (  # vLLM's raw split renders the same
            AssistantMessage(reasoning="\nLet me think.\n", content="\n\n42"),
            "<think>\nLet me think.\n</think>\n\n42<|im_end|>",
        ),
        (
            AssistantMessage(reasoning="r", content="Calling.", tool_calls=[CALL, CALL]),
            f"<think>\nr\n</think>\n\nCalling.\n{CALL_TEXT}\n{CALL_TEXT}<|im_end|>",
        ),
        (
            AssistantMessage(reasoning="r", content=None, tool_calls=[CALL]),
            f"<think>\nr\n</think>\n\n{CALL_TEXT}<|im_end|>",
        ),
    ],
)
def test_render(qwen3_fmt, message, text):
    assert qwen3_fmt.render(message, "stop") == text


def test_render_thinking_off_and_length_cut(qwen3_fmt, qwen3_fmt_off):
    off = qwen3_fmt_off.render(AssistantMessage(content="hi", tool_calls=[CALL]), "stop")
    assert off == f"hi\n{CALL_TEXT}<|im_end|>"
    assert qwen3_fmt.render(AssistantMessage(reasoning="still thinking"), "length") == "<think>\nstill thinking"
    with pytest.raises(Exception, match="thinking is off"):
        qwen3_fmt_off.render(AssistantMessage(reasoning="r", content="x"), "stop")


GENERATIONS = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 42.<|im_end|>", "stop"),
    (f"<think>\nr\n</think>\n\nCalling.\n{CALL_TEXT}\n{CALL_TEXT}<|im_end|>", "stop"),
    (f"<think>\nr\n</think>\n\n{CALL_TEXT}\nthen some text<|im_end|>", "stop"),
    ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "f", "argu', "length"),
    (f"<think>\nr\n{CALL_TEXT}<|im_end|>", "stop"),
    ("<think>\ncut inside the reasoning", "length"),
    ("<think>\nr\n</think>\n\nA literal <think> in the answer.<|im_end|>", "stop"),
]


@pytest.mark.parametrize(("text", "finish"), GENERATIONS)
def test_parse_ids_renders_back_to_the_ids(qwen3_fmt, text, finish):
    ids = qwen3_fmt.codec.encode_batch([text])[0]
    parsed = qwen3_fmt.parse_ids(ids, finish)
    rebuilt = qwen3_fmt.encode_parts_batch([qwen3_fmt.render_parts(parsed.message, parsed.finish_reason)])[0]
    assert rebuilt == ids


def test_parse_ids_splits_by_id(qwen3_fmt):
    ids = qwen3_fmt.codec.encode_batch([f"<think>\nr\n</think>\n\nCalling.\n{CALL_TEXT}<|im_end|>"])[0]
    parsed = qwen3_fmt.parse_ids(ids)
    assert parsed.finish_reason == "stop" and parsed.stop_token_id == IM_END
    assert parsed.message.reasoning == "\nr\n" and parsed.message.content == "\n\nCalling.\n"
    assert parsed.message.tool_calls == [CALL] and parsed.message.tool_tail is None


def test_a_literal_tag_in_text_is_structure(qwen3_fmt):
    """`<think>` is not special: ordinary encoding of an answer's text gives the tag's id, so a
    rebuild cannot keep it as text, and the literal check only reports the special names."""
    assert qwen3_fmt.codec.encode_ordinary_batch(["a <think> b"])[0].count(THINK) == 1
    assert IM_END not in qwen3_fmt.codec.encode_ordinary_batch(["a <|im_end|> b"])[0]
    assert qwen3_fmt.literal_special_text(["x <|im_end|> y"]) == ["<|im_end|>"]


def test_provider_view_notes_what_the_parsers_change(qwen3_fmt):
    def view(text, finish="stop", tools=None):
        return qwen3_fmt.provider_view(qwen3_fmt.codec.encode_batch([text])[0], finish, tools)

    clean = view(f"<think>\nr\n</think>\n\nCalling.\n{CALL_TEXT}<|im_end|>")
    assert clean.notes == [] and clean.finish_reason == "tool_calls"
    assert clean.message["tool_calls"][0]["id"] == "call_0"
    compact = view('<think>\nr\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call><|im_end|>')
    assert compact.notes == ["tool call re-serialised by the tool parser"]
    assert compact.message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert view(f"<think>\nr\n</think>\n\n{CALL_TEXT} after<|im_end|>").notes == [
        "text between or after tool calls dropped by the tool parser"
    ]
    assert view("no opening tag</think>\n\nx<|im_end|>").notes == [
        "generation does not open with <think>: the rebuild inserts one"
    ]
    cut = view("<think>\nr\n</think>", "length")
    assert cut.hides_last_token is not None and cut.message["reasoning_content"] == "\nr\n"
    unparsed = view(f"<think>\nr\n</think>\n\n{CALL_TEXT}<|im_end|>", tools=[])
    assert unparsed.message["content"].endswith("</tool_call>") and unparsed.notes == []


def test_generation_prompt_follows_the_mode(qwen3_fmt, qwen3_fmt_off, qwen3_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    on = qwen3_tokenizer.decode(qwen3_fmt.generation_prompt_ids(messages))
    off = qwen3_tokenizer.decode(qwen3_fmt_off.generation_prompt_ids(messages))
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    assert qwen3_fmt.generation_prompt_ids(messages)[-2:] != [THINK, THINK_END]
    assert CALL_END not in qwen3_fmt.generation_prompt_ids(messages)


def test_the_audit_passes_with_the_family_reference_ids(qwen3_tokenizer):
    from eagle3_data.stages.audit.tokenizer_audit import audit_tokenizer

    report = audit_tokenizer(qwen3_tokenizer, dict(Qwen3Format.reference_ids))
    assert report.passed, report.problems
    assert report.output_format == "qwen3" and report.special_ids["<|im_end|>"] == IM_END
    wrong = audit_tokenizer(qwen3_tokenizer, {**Qwen3Format.reference_ids, "<think>": THINK_END})
    assert not wrong.passed


def test_images_are_refused(qwen3_fmt):
    with pytest.raises(Exception, match="text model"):
        qwen3_fmt.generation_prompt_ids([{"role": "user", "content": "x"}], images=[{"ref": "a.png"}])


RESHAPED = [
    ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call><|im_end|>', "stop"),
    ("no opening tag\n</think>\n\nx<|im_end|>", "stop"),
    ("<think>\nr <think> again\n</think>\n\nx </think> y<|im_end|>", "stop"),
    ("<think>\nr\n</think>\n\nok", "length"),
]


@pytest.mark.parametrize(("text", "finish"), GENERATIONS + RESHAPED)
def test_a_view_without_notes_rebuilds_the_ids(qwen3_fmt, text, finish):
    """What the gate relies on: the provider's message renders back to the generated ids unless
    a note says how the parsers reshaped it."""
    ids = qwen3_fmt.codec.encode_batch([text])[0]
    view = qwen3_fmt.provider_view(ids, finish, None)
    message = AssistantMessage.from_openai(view.message)
    rebuilt = qwen3_fmt.encode_parts_batch([qwen3_fmt.render_parts(message, view.finish_reason)])[0]
    if view.hides_last_token:
        ids = ids[:-1]
    assert (rebuilt == ids) == (view.notes == []), view.notes
