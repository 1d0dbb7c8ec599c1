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


# ---------------------------------------------------------------- length cuts: faithful or not

def _provider_message(tok, ids: list[int]) -> AssistantMessage:
    """What a provider returns for generated ids, as SGLang's kimi_k2 parsers do: reasoning up to
    `</think>`; content = text before `<|tool_calls_section_begin|>`; only complete calls."""
    import re

    text = tok.decode(ids)
    reasoning, closed, rest = (text.split("</think>", 1) + [""])[0], "</think>" in text, text.split("</think>", 1)[-1]
    if not closed:
        return AssistantMessage(reasoning=reasoning, content="")
    content = rest.split("<|tool_calls_section_begin|>", 1)[0]
    calls = re.findall(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.]+):\d+\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", rest)
    return AssistantMessage(reasoning=reasoning, content=content, tool_calls=[ToolCall("x", n, a) for n, a in calls])


FULL_TOOL_TEXT = ("Look it up 东京 🙂.</think>Calling now.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                  '<|tool_call_argument_begin|>{"x": "多"}<|tool_call_end|><|tool_call_begin|>functions.g:1'
                  '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
FULL_PLAIN_TEXT = "Think: 東京 and 🚀 and naïve.</think>The answer — 四十二 🙂 — is\n\n```py\nx = 1\n```<|im_end|>"


def test_every_cut_inside_a_tool_section_is_unreconstructable(kimi_tokenizer):
    """Cut after every generated token of a tool-calling answer: with tools offered no cut is
    called faithful; the ones the provider's text visibly breaks say why."""
    from eagle3_data.reconstruct import unreconstructable_reason

    ids = kimi_tokenizer.encode(FULL_TOOL_TEXT, add_special_tokens=False)
    section = ids.index(kimi_tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>"))
    first_call_end = ids.index(kimi_tokenizer.convert_tokens_to_ids("<|tool_call_end|>"))
    for n in range(1, len(ids)):
        msg = _provider_message(kimi_tokenizer, ids[:n])
        reason = unreconstructable_reason(msg, "length", tools_offered=True)
        assert reason is not None, n
        if n > first_call_end:  # at least one complete call came back
            assert reason == "truncated inside tool-call section", n
        elif n > section:  # the section vanished from the text: indistinguishable from a content cut
            assert msg.tool_calls == [] and reason.startswith("truncated with tools offered"), n
            assert len(reconstruct(kimi_tokenizer, msg, "length")) < n  # why it must not be trusted
    full = _provider_message(kimi_tokenizer, ids[:-1])
    assert unreconstructable_reason(full, "tool_calls", tools_offered=True) is None  # finished: faithful


def test_cuts_inside_reasoning_or_content_without_tools_rebuild_the_generated_ids(kimi_tokenizer):
    """Every cut of a plain answer: faithful ones rebuild exactly the generated prefix (the cut
    right after `</think>` rebuilds the prefix without it); cuts inside a multi-byte character
    are refused."""
    from eagle3_data.reconstruct import unreconstructable_reason

    ids = kimi_tokenizer.encode(FULL_PLAIN_TEXT, add_special_tokens=False)
    think_end = ids.index(kimi_tokenizer.convert_tokens_to_ids("</think>"))
    faithful = refused = 0
    for n in range(1, len(ids)):
        msg = _provider_message(kimi_tokenizer, ids[:n])
        reason = unreconstructable_reason(msg, "length", tools_offered=False)
        if kimi_tokenizer.decode(ids[:n]).endswith("\ufffd"):
            assert reason == "truncated inside a multi-byte character", n
            refused += 1
            continue
        assert reason is None, n
        rebuilt = reconstruct(kimi_tokenizer, msg, "length")
        assert rebuilt == (ids[: n - 1] if n == think_end + 1 else ids[:n]), n
        faithful += 1
    assert refused >= 1 and faithful > 20


def test_row_to_reconstruct_marks_truncated_rows(kimi_tokenizer):
    fmt = get_output_format(kimi_tokenizer)
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    cases = [
        ({"content": "x", "tool_calls": call, "finish_reason": "length", "tools": tools}, "truncated inside tool-call section"),
        ({"content": "x", "finish_reason": "length", "tools": tools}, "truncated with tools offered"),
        ({"content": "x", "finish_reason": "length", "tools": "[]"}, None),
        ({"reasoning": "r", "content": "", "finish_reason": "length"}, None),
        ({"content": "x", "tool_calls": call, "finish_reason": "tool_calls", "tools": tools}, None),
        ({"content": "东\ufffd", "finish_reason": "length"}, "truncated inside a multi-byte character"),
    ]
    for row, want in cases:
        rec = row_to_reconstruct(fmt, {"sample_id": "s", **row}, "line 1")
        assert rec.unreconstructable is None if want is None else rec.unreconstructable.startswith(want), row
    with pytest.raises(UserError, match=r"line 1 \(sample_id s\): field 'tools' is not valid JSON"):
        row_to_reconstruct(fmt, {"sample_id": "s", "content": "x", "finish_reason": "stop", "tools": "[{"}, "line 1")
