"""The shipped sample datasets are well-formed OpenAI chat prompts the pipeline can consume.

The checker below is strict on purpose (it is what a hand-edited sample line gets wrong): it is
run against a deliberately malformed fixture too, so a regression in the checker shows up.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

SAMPLES = Path(__file__).resolve().parents[2] / "include" / "sample_data"
DATASETS = ("tool_calls", "code", "chat")
ROLES = {"system", "user", "assistant", "tool"}
CALL_ID = re.compile(r"^functions\.([A-Za-z0-9_\-]+):(\d+)$")


def problems(row: object) -> list[str]:
    """Everything wrong with one dataset line, as readable strings (empty when fine)."""
    if not isinstance(row, dict) or set(row) != {"messages", "tools"}:
        return ["line must be an object with exactly the keys 'messages' and 'tools'"]
    out: list[str] = []
    tools, messages = row["tools"], row["messages"]
    names: set[str] = set()
    if not isinstance(tools, list):
        return ["tools is not a list"]
    for i, tool in enumerate(tools):
        fn = tool.get("function", {}) if isinstance(tool, dict) else {}
        params = fn.get("parameters", {})
        if tool.get("type") != "function" or not fn.get("name") or params.get("type") != "object":
            out.append(f"tools[{i}] is not a function tool with object parameters")
            continue
        names.add(fn["name"])
        missing = set(params.get("required", [])) - set(params.get("properties", {}))
        if missing:
            out.append(f"tools[{i}] requires undeclared properties {sorted(missing)}")
    if not isinstance(messages, list) or not messages:
        return [*out, "messages is empty"]
    next_idx = 0
    open_calls: set[Any] = set()
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            out.append(f"messages[{i}].role {role!r} unknown")
            continue
        if role == "system" and i != 0:
            out.append(f"messages[{i}] system message not first")
        if role != "tool" and open_calls:
            out.append(f"messages[{i}] comes before results for {sorted(open_calls)}")
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in open_calls:
                out.append(f"messages[{i}].tool_call_id {cid!r} answers no open call")
            open_calls.discard(cid)
            if not isinstance(m.get("content"), str):
                out.append(f"messages[{i}].content of a tool result is not a string")
            continue
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            out.append(f"messages[{i}] tool_calls on a {role} message")
        if not calls and not (isinstance(m.get("content"), str) and m["content"].strip()):
            out.append(f"messages[{i}].content is empty")
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function", {})
            match = CALL_ID.match(call.get("id", ""))
            if not match or match[1] != fn.get("name") or int(match[2]) != next_idx:
                out.append(f"{where}.id {call.get('id')!r} is not functions.{fn.get('name')}:{next_idx}")
            if fn.get("name") not in names:
                out.append(f"{where} calls {fn.get('name')!r}, not among the offered tools")
            args = fn.get("arguments")
            try:
                parsed = json.loads(args) if isinstance(args, str) else None
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                out.append(f"{where}.arguments is not a JSON object string")
            open_calls.add(call.get("id"))
            next_idx += 1
    if open_calls:
        out.append(f"calls without results: {sorted(open_calls)}")
    if messages[-1].get("role") not in ("user", "tool"):
        out.append("last message must be user or tool: a prompt awaits the next assistant turn")
    return out


def load(name: str) -> list[dict]:
    lines = (SAMPLES / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_is_well_formed(name):
    rows = load(name)
    assert 30 <= len(rows) <= 40
    bad = {i: p for i, row in enumerate(rows) if (p := problems(row))}
    assert bad == {}
    canon = [json.dumps(r, sort_keys=True) for r in rows]
    assert len(set(canon)) == len(canon), "duplicate prompts"


def test_tool_calls_dataset_covers_the_cases():
    rows = load("tool_calls")
    assert {len(r["tools"]) for r in rows} == {1, 2, 3}
    with_history = [r for r in rows if any(m["role"] == "tool" for m in r["messages"])]
    assert len(with_history) >= 10
    assert any(sum("tool_calls" in m for m in r["messages"]) >= 2 for r in rows)  # index spans turns
    assert any(len(m.get("tool_calls", [])) >= 2 for r in rows for m in r["messages"])  # parallel calls
    assert any(r["messages"][-1]["role"] == "tool" for r in rows)


def test_code_and_chat_datasets_cover_the_cases():
    code, chat = load("code"), load("chat")
    assert sum(r["messages"][0]["role"] == "system" for r in code) >= 5
    assert sum("```" in m["content"] for r in code for m in r["messages"]) >= 10
    texts = [m["content"] for r in chat for m in r["messages"]]
    assert sum(any(m["role"] == "assistant" for m in r["messages"]) for r in chat) >= 6
    assert any(re.search(r"[\u4e00-\u9fff]", t) for t in texts)  # CJK ideographs
    assert any(re.search(r"[\u3040-\u30ff]", t) for t in texts)  # kana
    assert any(re.search(r"[\uac00-\ud7af]", t) for t in texts)  # hangul
    assert any(any(ord(c) >= 0x1F300 for c in t) for t in texts)  # emoji outside the BMP


MALFORMED = [
    ({"messages": []}, "exactly the keys"),
    ({"messages": [{"role": "robot", "content": "hi"}], "tools": []}, "role 'robot' unknown"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}], "tools": []}, "not first"),
    (
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "functions.get_weather:1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{}"},
            ],
            "tools": [],
        },
        "is not functions.get_weather:0",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": []},
        "last message must be user or tool",
    ),
]


@pytest.mark.parametrize("row,expected", MALFORMED)
def test_checker_rejects_malformed_rows(row, expected):
    assert any(expected in p for p in problems(row)), problems(row)


def test_malformed_tool_call_reports_every_fault():
    found = problems(MALFORMED[3][0])
    assert any("not among the offered tools" in p for p in found)
    assert any("arguments is not a JSON object string" in p for p in found)
    assert any("answers no open call" in p for p in found)


@pytest.mark.parametrize("name", DATASETS)
def test_every_prompt_renders_with_the_kimi_chat_template(name, kimi_tokenizer):
    """The model's own template accepts every prompt (tool results, tool declarations, CJK)."""
    think, im_end = kimi_tokenizer.convert_tokens_to_ids(["<think>", "<|im_end|>"])
    for i, row in enumerate(load(name)):
        ids = kimi_tokenizer.apply_chat_template(
            row["messages"],
            tools=row["tools"] or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert ids[-1] == think, f"{name} row {i}"
        assert ids.count(im_end) == len(row["messages"]) + bool(row["tools"]), f"{name} row {i}"
