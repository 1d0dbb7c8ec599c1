"""Reconstruction with the real Kimi tokenizer: FACTS.md's reference ids, tool calls, batches."""

from __future__ import annotations

import json

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall, get_output_format
from eagle3_data.errors import UserError
from eagle3_data.reconstruct import reconstruct, reconstruct_batch, reconstruct_rows, row_to_reconstruct

REFERENCE_IDS = [9413, 1019, 2704, 13, 163607, 1008, 7574, 387, 220, 5512, 13, 163586]


def test_reference_string_ids(kimi_tokenizer):
    msg = AssistantMessage(reasoning="Let me think.", content="The answer is 42.")
    assert reconstruct(kimi_tokenizer, msg, "stop") == REFERENCE_IDS
    assert reconstruct(kimi_tokenizer, msg, "length") == REFERENCE_IDS[:-1]


def test_one_encode_over_the_whole_text_merges_across_parts(kimi_tokenizer):
    """Content starting with " NOR" right after </think> and reasoning ending mid-word: one encode."""
    msg = AssistantMessage(reasoning="A", content=" NOR")
    assert reconstruct(kimi_tokenizer, msg, "stop") == kimi_tokenizer.encode("A</think> NOR<|im_end|>", add_special_tokens=False)


def test_batch_with_tool_calls_and_conversation_index(kimi_tokenizer):
    fmt = get_output_format(kimi_tokenizer)
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "1"}]
    row = {"sample_id": "s1", "reasoning": "ok", "content": None, "finish_reason": "tool_calls", "messages": json.dumps(history),
           "tool_calls": [{"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    rec = row_to_reconstruct(fmt, row, "line 1")
    assert rec.tool_call_index_start == 1
    [(back, ids)] = list(reconstruct_rows(kimi_tokenizer, [rec]))
    assert back is rec
    assert kimi_tokenizer.decode(ids) == (
        "ok</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    many = reconstruct_batch(kimi_tokenizer, [rec.message] * 3 + [AssistantMessage(content="x")], ["stop"] * 4, [1, 1, 1, 0])
    assert many[:3] == [ids] * 3 and many[3] == kimi_tokenizer.encode("</think>x<|im_end|>", add_special_tokens=False)


def test_parsed_local_generation_reconstructs_its_ids(kimi_tokenizer):
    fmt = get_output_format(kimi_tokenizer)
    text = ("Plan: call it.</think>Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            '<|tool_call_argument_begin|>{"x": "多"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    ids = kimi_tokenizer.encode(text, add_special_tokens=False)
    parsed = fmt.parse_ids(ids)
    assert reconstruct(kimi_tokenizer, parsed.message, parsed.finish_reason, 0) == ids
    renamed = AssistantMessage(parsed.message.reasoning, parsed.message.content,
                               [ToolCall("call_zzz", "f", parsed.message.tool_calls[0].arguments)])
    assert reconstruct(kimi_tokenizer, renamed, "tool_calls") == ids  # provider ids re-derived


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"content": "x", "finish_reason": "stop"}, "line 3: field 'sample_id'"),
        ({"sample_id": "a", "content": "x", "finish_reason": "error"}, r"line 3 \(sample_id a\): field 'finish_reason'"),
        ({"sample_id": "a", "content": 5, "finish_reason": "stop"}, "field 'content' is not a string"),
        ({"sample_id": "a", "tool_calls": "[oops", "finish_reason": "stop"}, "field 'tool_calls'"),
        ({"sample_id": "a", "messages": "{", "finish_reason": "stop"}, "field 'messages' is not valid JSON"),
    ],
)
def test_bad_rows_name_row_and_field(kimi_tokenizer, row, match):
    with pytest.raises(UserError, match=match):
        row_to_reconstruct(get_output_format(kimi_tokenizer), row, "line 3")
