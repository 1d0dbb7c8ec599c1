"""The layouts prompt datasets come in (prompt_layouts): ShareGPT `conversations`, a plain
`prompt`, OpenAI `messages`; JSONL, Parquet and a `datasets` save_to_disk folder. Each maps to
the same messages (so the same sample id) as the equivalent OpenAI row, and a row that breaks
its layout is refused naming its own field, the good rows kept."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.errors import UserError
from eagle3_data.stages.prompts.load import PromptShape, load_prompts

SAMPLING = {"temperature": 1.0}
TOOLS = [
    {
        "name": "weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]

SHAREGPT = {
    "system": "be brief",
    "tools": json.dumps(TOOLS),
    "conversations": [
        {"from": "human", "value": "weather in Paris and Oslo?"},
        {
            "from": "function_call",
            "value": json.dumps(
                [
                    {"name": "weather", "arguments": {"city": "Paris"}},
                    {"name": "weather", "arguments": {"city": "Oslo"}},
                ]
            ),
        },
        {"from": "observation", "value": "18C"},
        {"from": "observation", "value": "9C"},
        {"from": "gpt", "value": "Paris 18C, Oslo 9C."},
        {"from": "human", "value": "and Rome?"},
    ],
}


def call(k: int, city: str) -> dict:
    return {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": city})},
    }


OPENAI = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call(0, "Paris"), call(1, "Oslo")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "9C"},
        {"role": "assistant", "content": "Paris 18C, Oslo 9C."},
        {"role": "user", "content": "and Rome?"},
    ],
    "tools": [{"type": "function", "function": t} for t in TOOLS],
}


def load(tmp_path: Path, rows: list, name: str = "d") -> object:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_prompts(str(path), name, PromptShape(sampling=SAMPLING))


def test_sharegpt_with_parallel_calls_is_the_openai_row(tmp_path):
    a, b = load(tmp_path, [SHAREGPT], "a"), load(tmp_path, [OPENAI], "a")
    (ra,), (rb,) = list(a.rows), list(b.rows)
    assert json.loads(ra["messages"]) == json.loads(rb["messages"])
    assert ra["tools"] == rb["tools"] and ra["sample_id"] == rb["sample_id"]
    assert a.counts["ignored_fields"] == 0  # system and tools are the layout's own fields


def test_text_then_call_is_one_assistant_turn_and_results_pair_in_order(tmp_path):
    row = {
        "conversations": [
            {"from": "user", "value": "hi"},
            {"from": "gpt", "value": "checking"},
            {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": '{"city": "Rome"}'})},
            {"from": "tool", "value": "20C"},
            {"from": "human", "value": "thanks"},
        ]
    }
    (r,) = list(load(tmp_path, [row]).rows)
    messages = json.loads(r["messages"])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1] == {"role": "assistant", "content": "checking", "tool_calls": [call(0, "Rome")]}
    assert messages[2]["tool_call_id"] == "call_0"


def test_a_plain_prompt_is_one_user_message(tmp_path):
    (r,) = list(load(tmp_path, [{"prompt": "write a haiku", "system": "a poet", "source": "x"}]).rows)
    assert json.loads(r["messages"]) == [
        {"role": "system", "content": "a poet"},
        {"role": "user", "content": "write a haiku"},
    ]
    same = next(
        iter(
            load(
                tmp_path,
                [{"messages": [{"role": "system", "content": "a poet"}, {"role": "user", "content": "write a haiku"}]}],
                "e",
            ).rows
        )
    )
    assert json.loads(same["messages"]) == json.loads(r["messages"])


BAD = [  # (row, field the reject names)
    ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from"),
    ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value"),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "18C"}]},
        "conversations[1].from",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{not json"}]},
        "conversations[1].value",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": '{"arguments": {}}'}]},
        "conversations[1].value.name",
    ),
    (
        {"conversations": [{"from": "system", "value": "x"}, {"from": "gpt", "value": "done"}]},
        "conversations as messages[1].role",
    ),
    (
        {
            "conversations": [
                {"from": "human", "value": "x"},
                {"from": "function_call", "value": '{"name": "f"}'},
                {"from": "gpt", "value": "wait"},
                {"from": "observation", "value": "42"},
            ]
        },
        "conversations as messages[3].role",
    ),  # a result must follow its call's turn
    ({"conversations": "[" * 5000}, "conversations"),
    ({"conversations": []}, "conversations as messages"),
    ({"prompt": ["not", "a", "string"]}, "prompt"),
    ({"prompt": "x", "system": 7}, "system"),
]


@pytest.mark.parametrize("row, field", BAD)
def test_a_row_that_breaks_its_layout_is_refused_naming_its_field(tmp_path, row, field):
    result = load(tmp_path, [{"prompt": "good"}, row, SHAREGPT])
    assert len(result.rows) == 2  # the good rows are kept
    (reject,) = result.rejects
    assert reject["line"] == 2 and reject["field"] == field, reject
    assert f"line 2: {field}" in reject["reason"]


def test_parquet_with_conversations_as_structs(tmp_path):
    (tmp_path / "d").mkdir()
    pq.write_table(
        pa.Table.from_pylist(
            [{"conversations": SHAREGPT["conversations"], "system": "be brief", "tools": SHAREGPT["tools"]}]
        ),
        tmp_path / "d" / "part.parquet",
    )
    (r,) = list(load_prompts(str(tmp_path), "d", PromptShape(sampling=SAMPLING)).rows)
    assert json.loads(r["messages"]) == OPENAI["messages"]


def test_a_datasets_save_to_disk_folder_is_read_in_its_files_order(tmp_path):
    import datasets

    rows = [
        {"conversations": SHAREGPT["conversations"], "system": "be brief", "tools": SHAREGPT["tools"], "prompt": None}
    ]
    rows += [{"conversations": None, "system": None, "tools": None, "prompt": f"question {i}"} for i in range(40)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=3)  # several .arrow files
    assert len(json.loads((folder / "state.json").read_text())["_data_files"]) == 3
    result = load_prompts(str(folder), "anything", PromptShape(sampling=SAMPLING))
    loaded = list(result.rows)
    assert not result.rejects and len(loaded) == 41
    assert json.loads(loaded[0]["messages"]) == OPENAI["messages"]
    assert [json.loads(r["messages"])[-1]["content"] for r in loaded[1:]] == [f"question {i}" for i in range(40)]
    (folder / json.loads((folder / "state.json").read_text())["_data_files"][-1]["filename"]).unlink()
    with pytest.raises(UserError, match="state.json lists files that are not there"):
        load_prompts(str(folder), "anything", PromptShape(sampling=SAMPLING))


def test_the_mapped_conversation_renders_with_the_real_template(tmp_path, kimi_tokenizer):
    """What the model sees: the calls with their synthesised ids and each result after its call."""
    (r,) = list(load(tmp_path, [SHAREGPT]).rows)
    text = kimi_tokenizer.apply_chat_template(
        json.loads(r["messages"]), tools=json.loads(r["tools"]), tokenize=False, add_generation_prompt=True
    )
    paris, oslo, first, second = (text.index(s) for s in ('{"city": "Paris"}', '{"city": "Oslo"}', "18C", "9C"))
    assert paris < oslo < first < second < text.index("and Rome?")
    assert text.count("<|tool_call_begin|>call_0") == 1 and text.count("<|tool_call_begin|>call_1") == 1


CONVERSATION = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "weather?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "9C"},
        {"from": "gpt", "value": "9C in Oslo."},
        {"from": "human", "value": "thanks"},
        {"from": "gpt", "value": "bye"},
    ]
}


def test_every_turn_is_one_sample_per_user_turn_after_the_datasets_history(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CONVERSATION) + "\n")
    final = load_prompts(str(path), "c", PromptShape(sampling=SAMPLING))
    every = load_prompts(str(path), "c", PromptShape(sampling=SAMPLING, regenerate="every_turn"))
    # final_turn answers the row's last user turn again, its dataset answer left out: every_turn's last sample
    assert [r["sample_id"] for r in final.rows] == [list(every.rows)[-1]["sample_id"]]
    prompts = [json.loads(r["messages"]) for r in every.rows]
    assert [len(p) for p in prompts] == [2, 4, 8] and all(p[-1]["role"] == "user" for p in prompts)
    assert prompts[2][:7] == prompts[1] + prompts[2][4:7] and prompts[2][4]["tool_calls"][0]["id"] == "call_0"
    assert len({r["sample_id"] for r in every.rows}) == 3 and [r["sample_index"] for r in every.rows] == [0, 1, 2]
    # a turn's sample is the same whatever comes after it in the row: the first equals the row cut there
    path.write_text(json.dumps({"conversations": CONVERSATION["conversations"][:2]}) + "\n")
    assert (
        next(iter(load_prompts(str(path), "c", PromptShape(sampling=SAMPLING)).rows))["sample_id"]
        == next(iter(every.rows))["sample_id"]
    )


def test_every_turn_renders_the_earlier_turns_as_the_template_does_there(tmp_path, kimi_tokenizer):
    """What the model saw at turn 3: the earlier answers with their reasoning dropped by Kimi's
    template (`<think></think>`), ending with the generation prompt."""
    from eagle3_data.chat_format import get_output_format

    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "thinking about a"},
            {"role": "user", "content": "c"},
        ]
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    rows = list(load_prompts(str(path), "r", PromptShape(sampling=SAMPLING, regenerate="every_turn")).rows)
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    second = fmt.generation_prompt_ids(json.loads(rows[1]["messages"]), None)
    text = kimi_tokenizer.decode(second)
    assert "thinking about a" not in text and "<think></think>b" in text.replace("\n", "")
    assert second == kimi_tokenizer.apply_chat_template(
        row["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
    )
