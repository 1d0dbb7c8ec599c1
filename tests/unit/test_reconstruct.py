"""Reconstruction with the real Kimi tokenizer: FACTS.md's reference ids, tool calls, batches."""

from __future__ import annotations

import json

import pytest

from eagle3_data.chat_format import AssistantMessage, ToolCall
from eagle3_data.errors import UserError
from eagle3_data.reconstruction import reconstruct, reconstruct_batch, reconstruct_rows, row_to_reconstruct
from tests.fixtures.kimi import IM_END, IM_END_AS_TEXT, REFERENCE_IDS, THINK_END


@pytest.fixture(scope="module")
def fmt(kimi_fmt):
    return kimi_fmt


def test_reference_string_ids(fmt):
    msg = AssistantMessage(reasoning="Let me think.", content="The answer is 42.")
    assert reconstruct(fmt, msg, "stop") == REFERENCE_IDS
    assert reconstruct(fmt, msg, "length") == REFERENCE_IDS[:-1]


def test_one_encode_over_the_whole_text_merges_across_parts(fmt, kimi_tokenizer):
    """Content starting with " NOR" right after </think> and reasoning ending mid-word: one encode."""
    msg = AssistantMessage(reasoning="A", content=" NOR")
    assert reconstruct(fmt, msg, "stop") == kimi_tokenizer.encode("A</think> NOR<|im_end|>", add_special_tokens=False)


def test_thinking_off_rebuild_has_no_think_end(kimi_fmt_off):
    """Thinking off: the prompt already ends `<think></think>`; the model never generates one."""
    rec = row_to_reconstruct(
        kimi_fmt_off, {"sample_id": "s", "reasoning": None, "content": "Hi.", "finish_reason": "stop"}, "line 1"
    )
    [(_, ids)] = list(reconstruct_rows(kimi_fmt_off, [rec]))
    assert THINK_END not in ids and ids[-1] == IM_END
    assert reconstruct(kimi_fmt_off, AssistantMessage(content="Hi."), "stop") == ids


def test_literal_special_token_text_stays_text(fmt):
    """A provider passes a literal `<|im_end|>` through: it is the six text tokens the model wrote."""
    row = {
        "sample_id": "s",
        "reasoning": "r",
        "content": "Write <|im_end|> literally.",
        "finish_reason": "stop",
        "tool_calls": [
            {
                "id": "functions.f:0",
                "type": "function",
                "function": {"name": "f", "arguments": '{"t": "<|tool_call_begin|>"}'},
            }
        ],
    }
    rec = row_to_reconstruct(fmt, row, "line 1")
    assert rec.literal_special == ["<|im_end|>", "<|tool_call_begin|>"]
    [(_, ids)] = list(reconstruct_rows(fmt, [rec]))
    assert ids.count(IM_END) == 1 and ids.count(163597) == 1  # the stop id and the real call only
    assert IM_END_AS_TEXT[2:] == ids[ids.index(THINK_END) + 3 : ids.index(THINK_END) + 7]


def test_batch_with_tool_calls_and_conversation_index(fmt, kimi_tokenizer):
    history = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "1"},
    ]
    row = {
        "sample_id": "s1",
        "reasoning": "ok",
        "content": None,
        "finish_reason": "tool_calls",
        "messages": json.dumps(history),
        "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    rec = row_to_reconstruct(fmt, row, "line 1")
    assert rec.tool_call_index_start == 1
    [(back, ids)] = list(reconstruct_rows(fmt, [rec]))
    assert back is rec
    assert kimi_tokenizer.decode(ids) == (
        "ok</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    many = reconstruct_batch(fmt, [rec.message] * 3 + [AssistantMessage(content="x")], ["stop"] * 4, [1, 1, 1, 0])
    assert many[:3] == [ids] * 3 and many[3] == kimi_tokenizer.encode("</think>x<|im_end|>", add_special_tokens=False)


def test_parsed_local_generation_reconstructs_its_ids(fmt, kimi_tokenizer):
    text = (
        "Plan: call it.</think>Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"x": "多"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    ids = kimi_tokenizer.encode(text, add_special_tokens=False)
    parsed = fmt.parse_ids(ids)
    assert reconstruct(fmt, parsed.message, parsed.finish_reason, 0) == ids
    renamed = AssistantMessage(
        parsed.message.reasoning,
        parsed.message.content,
        [ToolCall("call_zzz", "f", parsed.message.tool_calls[0].arguments)],
    )
    assert reconstruct(fmt, renamed, "tool_calls") == ids  # provider ids re-derived


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"content": "x", "finish_reason": "stop"}, "line 3: field 'sample_id'"),
        ({"sample_id": "a", "content": "x", "finish_reason": None}, r"line 3 \(sample_id a\): field 'finish_reason'"),
        ({"sample_id": "a", "content": 5, "finish_reason": "stop"}, "field 'content' is not a string"),
        ({"sample_id": "a", "tool_calls": "[oops", "finish_reason": "stop"}, "field 'tool_calls'"),
        ({"sample_id": "a", "messages": "{", "finish_reason": "stop"}, "field 'messages' is not valid JSON"),
    ],
)
def test_bad_rows_name_row_and_field(fmt, row, match):
    with pytest.raises(UserError, match=match):
        row_to_reconstruct(fmt, row, "line 3")


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
    calls = re.findall(
        r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.]+):\d+\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
        rest,
    )
    return AssistantMessage(reasoning=reasoning, content=content, tool_calls=[ToolCall("x", n, a) for n, a in calls])


FULL_TOOL_TEXT = (
    "Look it up 东京 🙂.</think>Calling now.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
    '<|tool_call_argument_begin|>{"x": "多"}<|tool_call_end|><|tool_call_begin|>functions.g:1'
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
)
FULL_PLAIN_TEXT = "Think: 東京 and 🚀 and naïve.</think>The answer — 四十二 🙂 — is\n\n```py\nx = 1\n```<|im_end|>"


def test_every_cut_inside_a_tool_section_is_unreconstructable(fmt, kimi_tokenizer):
    """Cut after every generated token of a tool-calling answer: with tools offered no cut is
    called faithful; the ones the provider's text visibly breaks say why."""
    from eagle3_data.reconstruction import unreconstructable_reason

    ids = kimi_tokenizer.encode(FULL_TOOL_TEXT, add_special_tokens=False)
    section = ids.index(kimi_tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>"))
    first_call_end = ids.index(kimi_tokenizer.convert_tokens_to_ids("<|tool_call_end|>"))
    for n in range(1, len(ids)):
        msg = _provider_message(kimi_tokenizer, ids[:n])
        reason = unreconstructable_reason(msg, "length", tools_offered=True, thinking=True)
        assert reason is not None, n
        if n > first_call_end:  # at least one complete call came back
            assert reason == "truncated inside tool-call section", n
        elif n > section:  # the section vanished from the text: indistinguishable from a content cut
            assert msg.tool_calls == [] and reason.startswith("truncated with tools offered"), n
            assert len(reconstruct(fmt, msg, "length")) < n  # why it must not be trusted
    full = _provider_message(kimi_tokenizer, ids[:-1])
    assert unreconstructable_reason(full, "tool_calls", tools_offered=True, thinking=True) is None  # finished: faithful


def test_cuts_inside_reasoning_or_content_without_tools_rebuild_the_generated_ids(fmt, kimi_tokenizer):
    """Every cut of a plain answer: faithful ones rebuild exactly the generated prefix (the cut
    right after `</think>` rebuilds the prefix without it); cuts inside a multi-byte character
    are refused."""
    from eagle3_data.reconstruction import unreconstructable_reason

    ids = kimi_tokenizer.encode(FULL_PLAIN_TEXT, add_special_tokens=False)
    think_end = ids.index(kimi_tokenizer.convert_tokens_to_ids("</think>"))
    faithful = refused = 0
    for n in range(1, len(ids)):
        msg = _provider_message(kimi_tokenizer, ids[:n])
        reason = unreconstructable_reason(msg, "length", tools_offered=False, thinking=True)
        if kimi_tokenizer.decode(ids[:n]).endswith("\ufffd"):
            assert reason == "truncated inside a multi-byte character", n
            refused += 1
            continue
        assert reason is None, n
        rebuilt = reconstruct(fmt, msg, "length")
        assert rebuilt == (ids[: n - 1] if n == think_end + 1 else ids[:n]), n
        faithful += 1
    assert refused >= 1 and faithful > 20


def test_row_to_reconstruct_marks_truncated_rows(fmt):
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    cases = [
        (
            {"content": "x", "tool_calls": call, "finish_reason": "length", "tools": tools},
            "truncated inside tool-call section",
        ),
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


def test_rows_that_cannot_be_rebuilt_say_why_and_get_no_ids(fmt, kimi_fmt_off):
    """Deliverable 6: no confident wrong rebuild."""
    tools = json.dumps([{"type": "function", "function": {"name": "web.search_v2", "parameters": {}}}])

    def call(name, call_id):
        return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}]

    base = {"sample_id": "s", "reasoning": "r", "content": "", "finish_reason": "tool_calls", "tools": tools}
    # a shortened name: the offered name the call id carries wins
    rec = row_to_reconstruct(fmt, {**base, "tool_calls": call("search_v2", "functions.web.search_v2:0")}, "line 1")
    assert rec.unreconstructable is None and rec.message.tool_calls[0].name == "web.search_v2"
    cases = [
        (
            {**base, "tool_calls": call("search_v2", "call_abc")},
            fmt,
            "tool name 'search_v2' is not among the offered tools",
        ),
        (
            {**base, "tools": None, "tool_calls": call("f", "call_1")},
            fmt,
            "tool name 'f' is not among the offered tools (none)",
        ),
        (
            {
                **base,
                "reasoning": None,
                "content": "x",
                "finish_reason": "stop",
                "usage": {"completion_tokens": 9, "reasoning_tokens": 5},
            },
            fmt,
            "reasoning billed (5 tokens) but absent",
        ),
        (
            {
                **base,
                "reasoning": "",
                "content": "x",
                "finish_reason": "stop",
                "usage": {"completion_tokens_details": {"reasoning_tokens": 2}},
            },
            fmt,
            "reasoning billed (2 tokens)",
        ),
        (
            {**base, "content": "x", "finish_reason": "content_filter"},
            fmt,
            "finish_reason 'content_filter' cannot be rebuilt",
        ),
        (
            {**base, "content": "x", "finish_reason": "stop"},
            kimi_fmt_off,
            "reasoning returned although thinking is off",
        ),
    ]
    for row, f, want in cases:
        rec = row_to_reconstruct(f, row, "line 1")
        assert rec.unreconstructable and rec.unreconstructable.startswith(want), (row, rec.unreconstructable)
        assert list(reconstruct_rows(f, [rec])) == [(rec, [])]
    no_reasoning_billed = {
        **base,
        "reasoning": None,
        "content": "x",
        "finish_reason": "stop",
        "usage": {"reasoning_tokens": 0},
    }
    assert row_to_reconstruct(fmt, no_reasoning_billed, "line 1").unreconstructable is None
