"""Our provider's view (`OutputFormat.provider_view`) against SGLang 0.5.23's own kimi_k2 reasoning
and tool-call parsers, imported unstubbed from the real wheel (tests/fixtures/sglang_oracle.py).

A few hundred generations are built from seeded random parts: reasoning and content with literal
special-token text, implicit reasoning ends, a leading `<think>`, tool sections with whitespace
between their tokens, nested JSON, `}` inside strings, non-JSON and invalid-JSON arguments, bare
counter ids, text after the section, cuts at random tokens, thinking on and off, tools offered or
not. Our split must equal theirs on every one: the gate's rebuild is only as true as this split.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.fixtures.kimi import IM_END

REASONING = [
    "Let me think.",
    "",
    "多语言 😀 reasoning\n\n",
    "about <|im_end|> as text",
    "a literal </think> here, then more",
    "ends with a newline\n",
    " NOR",
    "mentions <|tool_calls_section_begin|> in passing",
]
CONTENT = [
    "The answer is 42.",
    "",
    "Write <|im_end|> literally.",
    "see <|tool_calls_section_begin|> here",
    "  spaced  ",
    "a second </think> in content",
    "<think> in content",
    "\n\nMarkdown:\n```py\nx = 1\n```",
]
ARGS = [
    '{"city": "Paris"}',
    "{}",
    '{"a": {"b": [1, "}"]}}',
    '{"s": "<|tool_call_begin|>"}',
    "[1, 2]",
    "{a: 1}",
    '{"q": "多", "n": 2}',
    '"just a string"',
    '{"x": "}<|tool_call_end|>"}',
]
NAMES = ["get_weather", "web.search_v2", "f"]
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {k: {} for k in ks}}}}
    for n, ks in zip(NAMES, (["city"], ["q", "n"], ["a"]))
]
WS = ["", "", "", " ", "\n", " \n "]


def _generation(rng: random.Random, fmt, history: int = 0) -> tuple[list, bool]:
    """Parts (text pieces and real special ids) of one generated answer, and whether it was cut;
    call ids mostly numbered on from the conversation's `history` calls, as Kimi writes them."""
    sid = fmt.special_ids
    parts: list = []
    with_section = rng.random() < 0.5
    if fmt.thinking or rng.random() < 0.05:
        if rng.random() < 0.1:
            parts.append(sid["<think>"])
        parts.append(rng.choice(REASONING))
        if not (with_section and rng.random() < 0.25):  # else: Kimi ends reasoning implicitly
            parts.append(sid["</think>"])
    parts.append(rng.choice(CONTENT))
    if with_section:
        parts += [sid["<|tool_calls_section_begin|>"], rng.choice(WS)]
        for i in range(rng.randint(0, 3)):
            name = rng.choice(NAMES)
            call_id = rng.choice(
                [f"functions.{name}:{history + i}"] * 6
                + [f"functions.{name}:{i}", f"{name}:{i}", str(i), f"functions.{name}"]
            )
            parts += [
                sid["<|tool_call_begin|>"],
                rng.choice(WS),
                call_id,
                rng.choice(WS),
                sid["<|tool_call_argument_begin|>"],
                rng.choice(WS),
                rng.choice(ARGS),
                rng.choice(WS),
                sid["<|tool_call_end|>"],
                rng.choice(WS),
            ]
        if rng.random() < 0.9:
            parts.append(sid["<|tool_calls_section_end|>"])
        if rng.random() < 0.1:
            parts.append(" trailing text")
    parts.append(IM_END)
    return parts, rng.random() < 0.25


@pytest.mark.parametrize("thinking", [True, False])
def test_provider_view_equals_sglangs_parsers(sglang_oracle, kimi_tokenizer, thinking):
    from eagle3_data.chat_format import get_output_format

    fmt = get_output_format(kimi_tokenizer, thinking=thinking)
    rng = random.Random(10 + thinking)
    disagreements, literal, checked = [], 0, 0
    for n in range(200):
        history = rng.choice([0, 0, 1, 3])
        parts, cut = _generation(rng, fmt, history)
        [ids] = fmt.encode_parts_batch([parts])
        finish = "stop"
        if cut:
            ids, finish = ids[: rng.randint(0, len(ids) - 1)], "length"
        tools = [] if rng.random() < 0.1 else TOOLS
        text = fmt.codec.decode(ids[:-1] if finish == "stop" else ids)
        view = fmt.provider_view(ids, finish, tools, history)
        ours = {
            "reasoning": view.message["reasoning_content"],
            "content": view.message["content"],
            "calls": [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "id": c["id"]}
                for c in view.message.get("tool_calls", [])
            ],
        }
        theirs = sglang_oracle.parse(text, thinking=thinking, tools=tools, history=history)
        literal += bool(fmt.literal_special_text([t for t in parts if isinstance(t, str)]))
        checked += 1
        if ours != theirs:
            disagreements.append({"case": n, "text": text, "ours": ours, "theirs": theirs})
    assert not disagreements, json.dumps(disagreements[:3], ensure_ascii=False, indent=1)
    assert checked == 200 and literal > 30  # the cases do exercise literal special-token text


def test_dev_server_schema_errors_are_sglangs(sglang_oracle):
    """The dev server's 400 bodies for /generate schema errors carry SGLang's own texts."""
    from eagle3_data.dev.inference_server.sglang_contract import generate_contract_error

    bodies = [
        {"input_ids": [1, 2], "sampling_params": {"seed": 3}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 1, "stop_token_ids": [163586]}},
        {"input_ids": ["a", "b"]},
        {"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.5}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}},
        {"input_ids": [1, 2.5]},
        {"input_ids": "12"},
        {"input_ids": [[1, 2], "x"]},
    ]
    for body in bodies:
        assert generate_contract_error(body) == sglang_oracle.contract_error(body), body


def test_our_image_requests_pass_sglangs_own_generate_contract(sglang_oracle):
    """SGLang's `/generate` schema (its generated decoder, api_contract.generate_contract_error)
    admits what our wire sends for image prompts: generation with one pad per image and
    `image_data`, and the policy check's scoring request with `return_logprob`,
    `logprob_start_len` and `top_logprobs_num` beside them; and refuses a malformed `image_data`
    (the check can fail)."""
    from eagle3_data.engines.client import Media
    from eagle3_data.engines.sglang import SGLANG

    media = Media(163_605, ["data:image/png;base64,iVBORw0KGgo="], [6])
    ids = [1, 163_602, *[163_605] * 6, 163_604, 2]
    sampling = SGLANG.sampling({"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 8})
    _, generate = SGLANG.request(ids, sampling, "s1.run.1", {}, media)
    _, score = SGLANG.score_request(ids + [10, 11], len(ids), "s1.policy.x.1", {}, 20, media)
    assert generate["image_data"] == score["image_data"] == media.urls
    assert generate["input_ids"].count(163_605) == score["input_ids"].count(163_605) == 1
    for body in (generate, score):
        assert sglang_oracle.contract_error(body) is None, body
    assert sglang_oracle.contract_error({**score, "image_data": {"url": 3}}) is not None
