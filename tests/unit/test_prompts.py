"""Prompt loading: validation with precise rejects, canonical JSON, stable sample ids, S3 and local."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.errors import UserError
from eagle3_data.stages.prompts.load import PromptShape, load_prompts, sample_id

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "include" / "sample_data"
SAMPLING = {"temperature": 1.0, "max_tokens": 512}
USER = {"role": "user", "content": "hi"}
CALL = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}

GOOD = [
    {"messages": [USER]},
    {
        "messages": [{"role": "system", "content": "be brief"}, USER],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    },
    {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
        ]
    },
    {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        "id": "kept-out",
        "meta": {"a": 1},
    },
]
BAD = [  # (row, field the reject must name)
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        {
            "messages": [
                USER,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x: 1"}}]},
                USER,
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "weight": 2}]}, "messages[0].weight"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [USER], "tools": {"name": "f"}}, "tools"),
    (
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "done"}]},
        "messages[1].role",
    ),
    ({"messages": [USER, {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"}]}, "messages[1].role"),
    (
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
                {"role": "tool", "tool_call_id": "functions.f:7", "content": "43"},
            ]
        },
        "messages[3].tool_call_id",
    ),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    ({"no_messages": True}, "messages"),
]


def write_jsonl(path: Path, rows: list, extra_lines: Sequence[str] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return path


def test_sample_data_loads_without_rejects():
    for dataset in ("chat", "code", "tool_calls"):
        load = load_prompts(str(SAMPLE_DATA), dataset, PromptShape(sampling=SAMPLING))
        assert load.rows and not load.rejects and load.counts["rows"] == len(load.rows)
        assert load.sources[0]["sha256"] == hashlib.sha256((SAMPLE_DATA / f"{dataset}.jsonl").read_bytes()).hexdigest()


def test_sample_id_is_hash_of_canonical_inputs():
    messages = [{"role": "user", "content": "héllo"}]
    expected = hashlib.sha256(
        (
            '{"dataset":"chat","index":1,"messages":[{"content":"héllo","role":"user"}],"sampling":{"max_tokens":512,"temperature":1.0},"tools":null}'
        ).encode()
    ).hexdigest()[:32]
    assert sample_id("chat", messages, None, SAMPLING, 1) == expected
    assert (
        sample_id("chat", [{"content": "héllo", "role": "user"}], [], dict(reversed(SAMPLING.items())), 1) == expected
    )
    others = {
        sample_id("code", messages, None, SAMPLING, 1),
        sample_id("chat", messages, None, SAMPLING, 0),
        sample_id("chat", messages, None, {"temperature": 0.7}, 1),
    }
    assert expected not in others and len(others) == 3


def test_malformed_rows_are_rejected_with_line_and_field_and_good_rows_kept(tmp_path):
    rows = GOOD[:2] + [b for b, _ in BAD] + GOOD[2:]
    src = write_jsonl(tmp_path / "p" / "mixed.jsonl", rows, extra_lines=["{not json", ""])
    load = load_prompts(str(src), "mixed", PromptShape(sampling=SAMPLING))
    assert len(load.rows) == len(GOOD)
    # the row's own `id` is kept (as provenance), not ignored; `meta` is
    assert load.counts == {
        "read": len(rows) + 1,
        "rejected": len(BAD) + 1,
        "duplicates": 0,
        "ignored_fields": 1,
        "rows": len(GOOD),
        "answers_dropped": 0,
    }
    assert [r["source_id"] for r in load.rows] == [None, None, None, "kept-out"]
    by_line = {r["line"]: r for r in load.rejects}
    for i, (_, field) in enumerate(BAD):
        reject = by_line[3 + i]
        assert reject["field"] == field, reject
        assert f"line {3 + i}: {field}" in reject["reason"] and str(src) in reject["reason"]
    assert by_line[len(rows) + 1]["reason"].endswith("not valid JSON")


def test_normalised_rows_are_canonical_json(tmp_path):
    src = write_jsonl(
        tmp_path / "d.jsonl", [GOOD[2], {"tools": None, "messages": [{"content": "hi", "role": "user", "name": None}]}]
    )
    rows = list(load_prompts(str(src), "d", PromptShape(sampling=SAMPLING)).rows)
    first = json.loads(rows[0]["messages"])
    assert first[1] == {"role": "assistant", "tool_calls": [CALL]}  # null content dropped, call kept verbatim
    assert rows[1]["messages"] == '[{"content":"hi","role":"user"}]' and rows[1]["tools"] is None


def test_repeats_and_duplicates(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD[0], GOOD[1], GOOD[0]])
    load = load_prompts(str(src), "d", PromptShape(sampling=SAMPLING, repeats=3))
    ids = [r["sample_id"] for r in load.rows]
    assert len(ids) == 6 == len(set(ids)) and load.counts["duplicates"] == 3
    assert [r["sample_index"] for r in load.rows] == [0, 1, 2, 3, 4, 5]
    again = load_prompts(str(src), "d", PromptShape(sampling=SAMPLING, repeats=3))
    assert [r["sample_id"] for r in again.rows] == ids


def test_parquet_with_struct_or_string_messages(tmp_path):
    structs = pa.Table.from_pylist(
        [
            {"messages": [USER, {"role": "assistant", "content": "a"}, USER]},
            {"messages": [{"role": "root", "content": "x"}]},
        ]
    )
    (tmp_path / "d").mkdir()
    pq.write_table(structs, tmp_path / "d" / "a.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"messages": json.dumps([USER]), "tools": None}]), tmp_path / "d" / "b.parquet"
    )
    load = load_prompts(str(tmp_path), "d", PromptShape(sampling=SAMPLING))
    assert len(load.rows) == 2 and [(r["line"], r["field"]) for r in load.rejects] == [(2, "messages[0].role")]
    assert [s["uri"].rsplit("/", 1)[1] for s in load.sources] == ["a.parquet", "b.parquet"]


def test_local_date_partition_and_missing_partition(tmp_path):
    write_jsonl(tmp_path / "chat" / "date=2026-11-28" / "part-0.jsonl", [GOOD[0]])
    write_jsonl(tmp_path / "chat" / "date=2026-11-29" / "part-0.jsonl", [GOOD[1]])
    load = load_prompts(str(tmp_path), "chat", PromptShape(sampling=SAMPLING), date="2026-11-29")
    assert len(load.rows) == 1 and "date=2026-11-29" in load.sources[0]["uri"]
    with pytest.raises(UserError, match=r"no prompt files .*'chat'.*date=2026-11-30"):
        load_prompts(str(tmp_path), "chat", PromptShape(sampling=SAMPLING), date="2026-11-30")
    with pytest.raises(UserError, match="invalid date"):
        load_prompts(str(tmp_path), "chat", PromptShape(sampling=SAMPLING), date="2026/11/29")


def test_a_run_without_logical_date_reads_the_newest_partition_or_undated_prompts(tmp_path, s3, s3_bucket):
    """prompt_date: the newest partition with files (an empty newer one passed over), locally and
    in S3; undated prompts when the source has them; neither: one line naming the dataset."""
    from types import SimpleNamespace

    from eagle3_data.config import load_config
    from eagle3_data.runs.run import Run, prompt_date

    write_jsonl(tmp_path / "chat" / "date=2026-11-28" / "part-0.jsonl", [GOOD[0]])
    write_jsonl(tmp_path / "chat" / "date=2026-11-29" / "part-0.jsonl", [GOOD[1]])
    (tmp_path / "chat" / "date=2026-11-30").mkdir()  # an upload not there yet
    write_jsonl(tmp_path / "code.jsonl", [GOOD[0]])
    config = load_config().with_overrides(
        {
            "datasets": [
                {"name": "chat", "prompts": str(tmp_path)},
                {"name": "code", "prompts": str(tmp_path)},
                {"name": "tool_calls", "prompts": str(tmp_path)},
                {"name": "s3chat", "prompts": f"s3://{s3_bucket}/p"},
            ]
        },
        where="test",
    )
    run = Run(
        config=config,
        run_key="manual",
        date=None,
        datasets=config.dataset_names,
        dry_run=False,
        skip_hidden_states=False,
    )
    store = SimpleNamespace(client=s3)
    assert prompt_date(run, store, "chat") == "2026-11-29"
    assert prompt_date(run, store, "code") is None  # its undated file
    with pytest.raises(UserError, match=r"dataset tool_calls: a run without a logical date .* found neither"):
        prompt_date(run, store, "tool_calls")
    s3.put_object(Bucket=s3_bucket, Key="p/s3chat/date=2026-11-27/a.jsonl", Body=b"{}\n")
    s3.put_object(Bucket=s3_bucket, Key="p/s3chat/date=2026-12-01/a.jsonl", Body=b"{}\n")
    assert prompt_date(run, store, "s3chat") == "2026-12-01"
    assert prompt_date(Run(**{**vars(run), "date": "2026-11-28"}), store, "chat") == "2026-11-28"  # a logical date wins


def test_a_missing_prompts_source_says_no_such_file_not_partition_advice(tmp_path, s3, s3_bucket):
    """Issue 55: a prompts file that is not there (local, or an s3:// key with nothing under it)
    got a paragraph about date partitions; "no such file" is what a person needs. A folder that
    exists but holds neither undated files nor partitions keeps the partition advice."""
    from types import SimpleNamespace

    from eagle3_data.config import load_config
    from eagle3_data.runs.run import Run, prompt_date

    (tmp_path / "empty").mkdir()
    sources = {
        "gone": str(tmp_path / "gone.jsonl"),
        "gonedir": str(tmp_path / "nowhere"),
        "s3gone": f"s3://{s3_bucket}/p/gone.jsonl",
        "empty": str(tmp_path / "empty"),
    }
    config = load_config().with_overrides(
        {"datasets": [{"name": n, "prompts": src} for n, src in sources.items()]}, where="test"
    )
    run = Run(config=config, run_key="m", date=None, datasets=list(sources), dry_run=False, skip_hidden_states=False)
    store = SimpleNamespace(client=s3)

    def message(name: str) -> str:
        with pytest.raises(UserError) as info:
            prompt_date(run, store, name)
        return str(info.value)

    assert message("gone") == f"prompts file {sources['gone']}: no such file (dataset gone)"
    assert message("gonedir") == f"prompts {sources['gonedir']}: no such file or folder (dataset gonedir)"
    assert message("s3gone") == f"prompts file {sources['s3gone']}: no such file (dataset s3gone)"
    assert "no date=YYYY-MM-DD partition" in message("empty")
    with pytest.raises(UserError, match=r"^prompts file .*gone\.jsonl: no such file \(dataset chat\)$"):
        load_prompts(sources["gone"], "chat", PromptShape(sampling=SAMPLING), date="2026-11-29")
    with pytest.raises(UserError, match=r"^prompts file s3://.*: no such file \(dataset chat\)$"):
        load_prompts(sources["s3gone"], "chat", PromptShape(sampling=SAMPLING), client=s3)


def test_s3_sources_file_prefix_and_date(s3, s3_bucket):
    body = (SAMPLE_DATA / "chat.jsonl").read_bytes()
    s3.put_object(Bucket=s3_bucket, Key="prompts/chat/date=2026-11-29/a.jsonl", Body=body)
    s3.put_object(Bucket=s3_bucket, Key="prompts/chat/date=2026-11-29/_SUCCESS", Body=b"")
    s3.put_object(Bucket=s3_bucket, Key="flat/chat.jsonl", Body=body)
    local = load_prompts(str(SAMPLE_DATA / "chat.jsonl"), "chat", PromptShape(sampling=SAMPLING))
    by_date = load_prompts(
        f"s3://{s3_bucket}/prompts", "chat", PromptShape(sampling=SAMPLING), date="2026-11-29", client=s3
    )
    by_file = load_prompts(f"s3://{s3_bucket}/flat/chat.jsonl", "chat", PromptShape(sampling=SAMPLING), client=s3)
    by_prefix = load_prompts(f"s3://{s3_bucket}/flat/", "chat", PromptShape(sampling=SAMPLING), client=s3)
    for load in (by_date, by_file, by_prefix):
        assert [r["sample_id"] for r in load.rows] == [r["sample_id"] for r in local.rows]
    assert by_date.sources == [
        {
            "uri": f"s3://{s3_bucket}/prompts/chat/date=2026-11-29/a.jsonl",
            "bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
    ]
    with pytest.raises(UserError, match="no prompt files"):
        load_prompts(f"s3://{s3_bucket}/prompts", "code", PromptShape(sampling=SAMPLING), date="2026-11-29", client=s3)


# -- loud rejects and limits (issue 13 item 4) ------------------------------------------------------
def _load_lines(tmp_path, lines: list[bytes], **kw):
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return load_prompts(str(path), "p", PromptShape(sampling={}, **kw))


def test_invalid_utf8_is_a_reject_not_a_replacement(tmp_path):
    load = _load_lines(
        tmp_path,
        [
            b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
            '{"messages": [{"role": "user", "content": "café"}]}'.encode(),
        ],
    )
    assert len(load.rows) == 1 and "\ufffd" not in next(iter(load.rows))["messages"]
    assert load.rejects[0]["line"] == 1 and "invalid UTF-8" in load.rejects[0]["reason"]


DEEP = "[" * 5000 + "]" * 5000  # past the JSON parser's own recursion limit


@pytest.mark.parametrize(
    "line, field, reason",
    [
        ('{"messages": [{"role": "user", "content": "hi"}], "meta": %s}' % DEEP, "", "nested deeper than 100 levels"),
        (
            '{"messages": [{"role": "user", "content": "hi"}], "meta": {"a": %s}}' % ("[" * 150 + "]" * 150),
            "meta.a",
            "nested deeper than 100 levels",
        ),
        (
            '{"messages": [{"role": "user", "content": "bad \\ud800 surrogate"}]}',
            "messages[0].content",
            "lone surrogate",
        ),
        ('{"messages": [{"role": "user", "content": "cut pair \\ud83d"}]}', "messages[0].content", "lone surrogate"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tag": "\\udc00"}', "tag", "lone surrogate"),
        (
            '{"messages": [{"role": "user", "content": "hi", "name": "x"}], "tools": "[{\\"type\\": \\"function\\", '
            '\\"function\\": {\\"name\\": \\"f\\", \\"description\\": \\"\\\\udfff\\"}}]"}',
            "tools[0].function.description",
            "lone surrogate",
        ),
    ],
)
def test_deep_nesting_and_lone_surrogates_are_rejects_not_crashes(tmp_path, line, field, reason):
    """Even in a field the loader ignores: the row is refused by line and field, the others kept."""
    good = '{"messages": [{"role": "user", "content": "emoji pair \\ud83d\\ude00 is fine"}]}'
    load = _load_lines(tmp_path, [good.encode(), line.encode(), good.replace("fine", "kept").encode()])
    assert len(load.rows) == 2 and "\U0001f600" in next(iter(load.rows))["messages"]
    [reject] = load.rejects
    assert reject["line"] == 2 and reject["field"] == field and reason in reject["reason"], reject
    reject["raw"].encode("utf-8")  # what goes to rejects.parquet is text


def test_parquet_rows_with_deep_or_surrogate_strings_are_rejects(tmp_path):
    path = tmp_path / "p.parquet"
    deep = json.dumps([{"role": "user", "content": "x", "name": "n"}]).replace('"n"', "[" * 120 + "]" * 120)
    pq.write_table(
        pa.table({"messages": [json.dumps([USER]), deep, json.dumps([{"role": "user", "content": "\ud800"}])]}), path
    )
    load = load_prompts(str(path), "p", PromptShape(sampling={}))
    assert len(load.rows) == 1
    assert [(r["line"], r["field"]) for r in load.rejects] == [(2, "messages[0].name"), (3, "messages[0].content")]


def test_message_byte_limit_and_prompt_token_limit(tmp_path):
    from eagle3_data.stages.prompts.load import limit_prompt_tokens

    msg = lambda text: json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    load = _load_lines(tmp_path, [msg("a" * 50), msg("short"), msg("b" * 30)], max_message_bytes=60, repeats=2)
    assert [r["line"] for r in load.rejects] == [1] and "limits.max_message_bytes" in load.rejects[0]["reason"]
    limit_prompt_tokens(load, 10, lambda messages, tools: len(messages[0]["content"]))
    assert [r["line"] for r in load.rejects] == [1, 3]  # one reject per line, not per repeat
    assert "30 prompt tokens, over the limit of 10" in load.rejects[1]["reason"]
    assert len(load.rows) == 2 and load.counts["rejected"] == 2  # "short" twice (2 repeats)


def test_unsupported_file_type_and_empty_loads_are_refused(tmp_path):
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts, require_rows

    (tmp_path / "p.csv").write_text("messages\nhi\n")
    with pytest.raises(UserError, match="unsupported file type '.csv'"):
        load_prompts(str(tmp_path / "p.csv"), "p", PromptShape(sampling={}))
    load = _load_lines(tmp_path, [b"{bad", b'{"messages": 3}'])
    with pytest.raises(UserError, match=r"0 usable prompt rows \(2 read, 2 rejected; first: .* line 1: not valid JSON"):
        require_rows(load, "x")


def test_rejects_are_grouped_by_kind_with_the_first_few_shown(tmp_path):
    from eagle3_data.stages.prompts.load import format_load_rejects

    bots = [json.dumps({"messages": [{"role": "bot", "content": str(i)}]}).encode() for i in range(5)]
    text = format_load_rejects(_load_lines(tmp_path, [b"{bad", *bots]), per_kind=2)
    assert text.splitlines()[0] == "REJECTED 6 of 6 prompt rows:"
    assert "5 x messages[].role: … is not one of system, user, assistant, tool" in text
    assert "line 2: messages[0].role: 'bot'" in text and "line 3:" in text and "line 4:" not in text
    assert "1 x row: not valid JSON" in text


def test_s3_source_needs_the_callers_client():
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts

    with pytest.raises(UserError, match="needs the caller's S3 client"):
        load_prompts("s3://bucket/prompts", "p", PromptShape(sampling={}))


# -- tool-call ids and trailing answers ---------------------------------------------------------------
def _weather(call_id: str, city: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
        ],
    }


WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
OPENAI_IDS = {
    "tools": WEATHER_TOOL,
    "messages": [  # an OpenAI-style dataset's own ids, reused per turn
        {"role": "user", "content": "Lisbon?"},
        _weather("call_w1", "Lisbon"),
        {"role": "tool", "tool_call_id": "call_w1", "content": "21"},
        {"role": "assistant", "content": "21."},
        {"role": "user", "content": "Porto?"},
        _weather("call_w1", "Porto"),
        {"role": "tool", "tool_call_id": "call_w1", "content": "17"},
        {"role": "assistant", "content": "17."},
        {"role": "user", "content": "thanks"},
    ],
}


def _load_one(tmp_path, record, **kwargs) -> list[dict]:
    src = write_jsonl(tmp_path / "ids.jsonl", [record])
    load = load_prompts(str(src), "ids", PromptShape(sampling=SAMPLING, **kwargs))
    assert not load.rejects, load.rejects
    return json.loads(next(iter(load.rows))["messages"])


def test_call_ids_become_the_formats_own_numbered_over_the_row(tmp_path, kimi_tokenizer):
    """The format's ids (`functions.{name}:{idx}`, idx counting the row's calls across turns) are
    what the real template renders as each call and its result; `given` keeps the dataset's."""
    from eagle3_data.chat_format.kimi_k2 import KimiK2Format

    messages = _load_one(tmp_path, OPENAI_IDS, call_id=KimiK2Format.call_id)
    assert [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
    ]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
    ]
    text = kimi_tokenizer.apply_chat_template(messages, tools=WEATHER_TOOL, tokenize=False, add_generation_prompt=True)
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:0\n21" in text and "## Return of functions.get_weather:1\n17" in text
    assert "call_w1" not in text
    given = _load_one(tmp_path, OPENAI_IDS)
    assert given == OPENAI_IDS["messages"]
    assert "## Return of call_w1" in kimi_tokenizer.apply_chat_template(
        given, tools=WEATHER_TOOL, tokenize=False, add_generation_prompt=True
    )


def test_sharegpt_calls_take_the_formats_ids(tmp_path):
    from eagle3_data.chat_format.kimi_k2 import KimiK2Format

    record = {
        "conversations": [
            {"from": "human", "value": "Lisbon and Porto?"},
            {
                "from": "function_call",
                "value": json.dumps(
                    [
                        {"name": "get_weather", "arguments": {"city": "Lisbon"}},
                        {"name": "get_time", "arguments": {"city": "Porto"}},
                    ]
                ),
            },
            {"from": "observation", "value": "21"},
            {"from": "observation", "value": "14:05"},
            {"from": "gpt", "value": "21, 14:05."},
            {"from": "human", "value": "thanks"},
        ]
    }
    messages = _load_one(tmp_path, record, call_id=KimiK2Format.call_id)
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:4]] == [
        ("functions.get_weather:0", "21"),
        ("functions.get_time:1", "14:05"),
    ]


def test_a_result_pairs_by_id_within_its_call_then_by_position(tmp_path):
    """Results whose id names a call of the message before them take it; the others take its calls
    left, in order: here `r-x` answers the second call by position after `b` took its own."""
    from eagle3_data.chat_format.kimi_k2 import KimiK2Format

    calls = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    record = {
        "messages": [
            USER,
            calls,
            {"role": "tool", "tool_call_id": "b", "content": "from g"},
            {"role": "tool", "tool_call_id": "r-x", "content": "from f"},
        ]
    }
    messages = _load_one(tmp_path, record, call_id=KimiK2Format.call_id)
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [
        ("functions.g:1", "from g"),
        ("functions.f:0", "from f"),
    ]


def test_final_turn_answers_again_a_row_that_ends_with_the_datasets_answer(tmp_path):
    """ShareGPT conversations end with the answer: final_turn leaves it out and regenerates it after
    the last user message (every row usable), counting the answers it dropped."""
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}"},
                {"from": "gpt", "value": f"answer {i}"},
                {"from": "human", "value": f"follow-up {i}"},
                {"from": "gpt", "value": f"last {i}"},
            ]
        }
        for i in range(3)
    ]
    load = load_prompts(str(write_jsonl(tmp_path / "sharegpt.jsonl", rows)), "sharegpt", PromptShape(sampling=SAMPLING))
    assert not load.rejects and len(load.rows) == 3 and load.counts["answers_dropped"] == 3
    for i, row in enumerate(load.rows):
        messages = json.loads(row["messages"])
        assert messages[-1] == {"role": "user", "content": f"follow-up {i}"} and len(messages) == 3
    # a row answered after a tool result: the trailing answer goes, the result stays the last message
    tool_row = {
        "messages": [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"},
            {"role": "assistant", "content": "It is 42."},
        ]
    }
    assert _load_one(tmp_path, tool_row)[-1] == {"role": "tool", "tool_call_id": "functions.f:0", "content": "42"}
