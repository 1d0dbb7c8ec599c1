"""Conversations regenerated turn by turn through the CLI's local stage on the dev server, in every
mode of `generation.regenerate` x `generation.history`, on include/sample_data/conversations.jsonl
(multi-turn, parallel tool calls with recorded results, ShareGPT and OpenAI layouts, an earlier
answer with reasoning). Every turn's prompt ids are checked against the real Kimi template's
render of that turn's messages, and every trajectory's record (ids and loss mask, as the merge
builds it) against the template's render at each of its turns."""

from __future__ import annotations

import io
import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.canonical import canonical_json
from eagle3_data.cli import main
from eagle3_data.config import default_config_raw
from eagle3_data.conversations import (
    SAMPLES_FILE,
    TurnRow,
    call_key,
    read_samples,
    recorded_results,
    trajectory_folds,
)
from eagle3_data.stages.merge.datasets import build_record
from eagle3_data.storage import StageRef
from tests.conversation_oracle import CONVERSATIONS, IM_END, render


def _generate(
    store,
    s3_server,
    kimi_tokenizer_dir,
    tmp_path,
    monkeypatch,
    run_key: str,
    *flags: str,
    thinking=True,
    prompts=CONVERSATIONS,
    call_ids="format",
):
    raw = default_config_raw()
    raw["generation"]["call_ids"] = call_ids
    raw["storage"]["bucket"] = store.bucket
    raw["tokenizer"]["source"] = str(kimi_tokenizer_dir)
    raw["generation"]["sampling"].update(max_new_tokens=160, thinking=thinking)
    raw["routing"].update(overflow_fraction=0.0, calibration_samples=0)  # every turn local: exact ids
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(raw))
    for name, value in (
        ("AWS_ACCESS_KEY_ID", s3_server.access_key),
        ("AWS_SECRET_ACCESS_KEY", s3_server.secret_key),
        ("AWS_ENDPOINT_URL", s3_server.endpoint_url),
        ("EAGLE3_JOURNAL_DIR", str(tmp_path / "j")),
    ):
        monkeypatch.setenv(name, value)
    assert (
        main(
            [
                "generate",
                "local",
                "--config",
                str(tmp_path / "pipeline.yaml"),
                "--dataset",
                "chat",
                "--prompts",
                str(prompts),
                "--run-key",
                run_key,
                "--dev",
                *flags,
            ]
        )
        == 0
    )
    return store.read_table(StageRef(run_key, "generate_local", "chat")).to_pylist()


def test_every_turn_on_the_datasets_history_generates_one_sample_per_user_turn(
    s3_server, store, kimi_tokenizer, kimi_tokenizer_dir, tmp_path, monkeypatch
):
    rows = _generate(store, s3_server, kimi_tokenizer_dir, tmp_path, monkeypatch, "turns", "--regenerate", "every_turn")
    lines = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    user_turns = sum(m["role"] == "user" for r in lines for m in r.get("messages", []))
    user_turns += sum(t["from"] == "human" for r in lines for t in r.get("conversations", []))
    assert len(rows) == user_turns == 10 and all(r["status"] == "ok" for r in rows)
    prompts = {r["sample_id"]: r for r in store.read_table(StageRef("turns", "prompts", "chat")).to_pylist()}
    assert set(prompts) == {r["sample_id"] for r in rows}
    for r in rows:
        p = prompts[r["sample_id"]]
        messages, tools = json.loads(p["messages"]), json.loads(p["tools"]) if p["tools"] else None
        assert messages[-1]["role"] == "user"
        assert r["prompt_ids"] == render(kimi_tokenizer, messages, tools), r["sample_id"]  # what the model saw
    # each turn's history is the row's own, up to that turn: the longest prompt of trip-1 holds its parallel calls
    longest = max((json.loads(p["messages"]) for p in prompts.values()), key=len)
    assert len(longest) == 11
    assert [c["function"]["name"] for c in longest[2]["tool_calls"]] == ["get_weather"] * 2 + ["get_local_time"] * 2
    assert store.read_manifest(StageRef("turns", "prompts", "chat"))["params"]["regenerate"] == "every_turn"


def _records(store, ref, rows) -> dict[str, dict]:
    """The merge's records of a stage's rows, its trajectory folds applied (Folds.apply + merge's build_record)."""
    samples = read_samples(store.get_bytes(ref, SAMPLES_FILE))
    folds = trajectory_folds(samples, {r["sample_id"]: (r["status"], r["error"]) for r in rows})
    out = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        row = folds.apply(TurnRow(r["sample_id"], r["prompt_ids"], r["output_ids"], r["provenance"]), Counter())
        if row is not None:
            taken = {**r, "sample_id": row.sample_id, "prompt_ids": row.prompt_ids, "output_ids": row.output_ids}
            out[row.sample_id] = build_record({**taken, "masked": row.masked}, 1 << 20, "truncate")[0]
    return out, samples


@pytest.mark.parametrize(
    "mode,history,thinking",
    [("trajectory", "dataset", True), ("trajectory", "regenerated", False), ("every_turn", "regenerated", True)],
)
def test_turns_regenerated_in_rounds_are_what_the_model_saw(
    mode, history, thinking, s3_server, store, kimi_tokenizer, kimi_tokenizer_dir, tmp_path, monkeypatch
):
    run_key = f"{mode}-{history}".replace("_", "-")
    rows = _generate(
        store,
        s3_server,
        kimi_tokenizer_dir,
        tmp_path,
        monkeypatch,
        run_key,
        "--regenerate",
        mode,
        "--history",
        history,
        thinking=thinking,
    )
    ref = StageRef(run_key, "generate_local", "chat")
    by_id = {r["sample_id"]: r for r in rows}
    conversations = {r["sample_id"]: r for r in store.read_table(StageRef(run_key, "prompts", "chat")).to_pylist()}
    assert len(conversations) == 4  # one prompt row per dataset row: its turns are asked for in rounds
    for r in rows:  # every turn's prompt is the template's render of its messages
        tools = json.loads(r["tools"]) if r["tools"] else None
        assert r["prompt_ids"] == render(kimi_tokenizer, json.loads(r["messages"]), tools, thinking), r["sample_id"]
    records, samples = _records(store, ref, rows)
    figures = store.read_manifest(ref)["extra"]["conversations"]
    print("conversation figures", json.dumps(figures, sort_keys=True))  # docs/generation.md's table: pytest -s
    assert figures["samples"] == len(samples) and figures["turns"] == sum(len(s["steps"]) for s in samples)
    assert sum(figures["end"].values()) == len(samples)
    user_turns = 10 if (mode, history) == ("trajectory", "dataset") else None
    if user_turns:
        assert len(samples) == user_turns  # one trajectory per user turn, each after the row's own history
    for s in samples:
        steps = [by_id[sid] for sid in s["steps"]]
        assert steps and all(t["status"] == "ok" for t in steps)
        conv = json.loads(conversations[s["conversation"]]["messages"])
        users = [i for i, m in enumerate(conv) if m["role"] == "user"]
        recorded = recorded_results(conv, users[s["user_turn"]] if history == "dataset" else users[0])
        last = steps[-1]
        tools = json.loads(last["tools"]) if last["tools"] else None
        messages = json.loads(last["messages"])
        expected_ids = render(kimi_tokenizer, messages, tools, thinking) + last["output_ids"]
        expected_mask = [0] * len(expected_ids)
        for j, t in enumerate(steps):
            start = len(t["prompt_ids"])
            if j + 1 < len(steps):  # the turn's render in the next prompt, up to its <|im_end|>
                nxt = steps[j + 1]["prompt_ids"]
                assert nxt[:start] == t["prompt_ids"]  # the trajectory's prompts chain
                end = nxt.index(IM_END, start) + 1
                # the messages between: this turn's answer, then each call's recorded result, in call order
                between = json.loads(steps[j + 1]["messages"])[len(json.loads(t["messages"])) :]
                assert between[0]["role"] == "assistant" and mode == "trajectory"
                calls = between[0]["tool_calls"]
                assert [m["content"] for m in between[1:]] == [recorded[call_key(c)].popleft() for c in calls]
                assert [m["tool_call_id"] for m in between[1:]] == [c["id"] for c in calls]
            else:
                end = start + len(t["output_ids"])
            expected_mask[start:end] = [1] * (end - start)
        record = records[s["sample_id"]]
        assert record["input_ids"] == expected_ids, s["sample_id"]
        assert record["loss_mask"] == expected_mask, s["sample_id"]
        assert s["end"] in ("answered", "unmatched_call", "length", "tool_calls", "max_steps")
        if s["end"] == "unmatched_call":
            miss = json.loads(s["unmatched"])
            assert not recorded.get(call_key({"function": miss}))  # none recorded, or every one taken
        if mode == "every_turn":
            assert len(steps) == 1
    # the earlier-turn rows are folded into their trajectory's record, none is a record of its own
    assert set(records) == {s["sample_id"] for s in samples}
    assert figures["splice_hits"] == sum(s["splice_hits"] for s in samples)
    if mode == "trajectory":
        assert figures["splice_hits"] > 0 and figures["splice_misses"] > 0  # enum cities hit, free-text queries miss
        assert max(len(s["steps"]) for s in samples) >= 2
        # parallel calls: a turn with two calls, both answered from the record, the trajectory going on
        assert any(len(json.loads(by_id[sid]["tool_calls"])) == 2 for s in samples for sid in s["steps"][:-1])
        assert figures["exact_turns"] == figures["earlier_turns"]  # the dev engine's ids are the template's own
    if history == "regenerated":  # a later turn's history is the answers generated before it
        for s in samples:
            if s["user_turn"] and s["steps"]:
                first = json.loads(by_id[s["steps"][0]]["messages"])
                dataset_answers = [
                    m for m in json.loads(conversations[s["conversation"]]["messages"]) if m["role"] == "assistant"
                ]
                history_answers = [m for m in first if m["role"] == "assistant"]
                assert history_answers and not any(
                    canonical_json(m) == canonical_json(d) for m in history_answers for d in dataset_answers
                )


def test_overflow_trajectories_resume_by_turn_and_pay_each_turn_once(store, start_dev_server, kimi_tokenizer, tmp_path):
    """The overflow path in rounds: a budget stop in the middle of the trajectories leaves the
    stage incomplete; the next attempt rebuilds every conversation from the committed turns and
    asks only for the turns after them: the dev server's counters say no turn was paid twice."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.conversations import TurnDriver
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts
    from tests.generation_calls import MODEL, generate_overflow

    server = start_dev_server({"price_per_token": {"prompt": 1e-6, "completion": 1e-5}})
    sampling = {"temperature": 0.0, "max_new_tokens": 96}
    rows = list(
        load_prompts(
            str(CONVERSATIONS), "chat", PromptShape(sampling=sampling, regenerate="trajectory", history="regenerated")
        ).rows
    )
    ref = StageRef("overflow-turns", "generate_overflow", "chat")
    fmt = get_output_format(kimi_tokenizer, thinking=True)

    def attempt(max_usd):
        return generate_overflow(
            store,
            ref,
            rows,
            kimi_tokenizer,
            server.url + "/v1",
            "sk-test",
            MODEL,
            {},
            max_usd,
            sampling={**sampling, "thinking": True},
            concurrency=2,
            rows_per_part=2,
            journal_dir=tmp_path / "j",
            first_cost_estimate_usd=0.0005,
            turns=TurnDriver("trajectory", "regenerated", fmt),
        )

    first = attempt(0.004)
    assert first["stopped_reason"] == "budget" and not first["complete"], first
    paid_first = sum(server.stats()["answered"].get("chat", {}).values())
    assert paid_first > 0
    second = attempt(None)
    assert second["complete"], second
    paid = server.stats()["answered"].get("chat", {})
    assert set(paid.values()) == {1}  # every turn paid once, across both attempts
    committed = store.read_table(ref).to_pylist()
    assert sorted(paid) == sorted(r["sample_id"] for r in committed) and len(committed) > paid_first
    samples = read_samples(store.get_bytes(ref, SAMPLES_FILE))
    assert {sid for s in samples for sid in s["steps"]} == {r["sample_id"] for r in committed if r["status"] == "ok"}
    figures = store.read_manifest(ref)["extra"]["conversations"]
    assert figures["turns"] == len(committed) and figures["splice_hits"] > 0
    for r in committed:  # the provider was sent each turn's messages; their render is the row's prompt ids
        tools = json.loads(r["tools"]) if r["tools"] else None
        assert r["prompt_ids"] == render(kimi_tokenizer, json.loads(r["messages"]), tools)


@pytest.mark.parametrize(
    "engine,mode",
    [("local", "final_turn"), ("local", "trajectory"), ("overflow", "final_turn"), ("overflow", "trajectory")],
)
def test_a_stage_with_nothing_routed_to_it_completes_empty(
    engine, mode, s3_server, store, kimi_tokenizer_dir, tmp_path, monkeypatch
):
    """`generate local --regenerate trajectory` with nothing routed local ended in
    `AttributeError: 'LogProgress' object has no attribute '_base'`, masking what happened."""
    raw = default_config_raw()
    raw["storage"]["bucket"] = store.bucket
    raw["tokenizer"]["source"] = str(kimi_tokenizer_dir)
    raw["routing"].update(overflow_fraction=0.0 if engine == "overflow" else 1.0, calibration_samples=0)
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(raw))
    for name, value in (
        ("AWS_ACCESS_KEY_ID", s3_server.access_key),
        ("AWS_SECRET_ACCESS_KEY", s3_server.secret_key),
        ("AWS_ENDPOINT_URL", s3_server.endpoint_url),
        ("EAGLE3_JOURNAL_DIR", str(tmp_path / "j")),
    ):
        monkeypatch.setenv(name, value)
    run_key = f"empty-{engine}-{mode.replace('_', '-')}"
    assert (
        main(
            [
                "generate",
                engine,
                "--config",
                str(tmp_path / "pipeline.yaml"),
                "--dataset",
                "chat",
                "--prompts",
                str(CONVERSATIONS),
                "--run-key",
                run_key,
                "--dev",
                "--regenerate",
                mode,
            ]
        )
        == 0
    )
    ref = StageRef(run_key, f"generate_{engine}", "chat")
    assert store.is_complete(ref) and store.read_table(ref).num_rows == 0


CITY_RESULTS = {"Lisbon": "Lisbon: 21 C, clear", "Porto": "Porto: 17 C, cloudy"}


@pytest.mark.parametrize("call_ids", ["format", "given"])
def test_reused_call_ids_splice_each_calls_own_recorded_result(
    call_ids, s3_server, store, kimi_tokenizer_dir, tmp_path, monkeypatch
):
    """A converted dataset reuses `call_0` in every turn (Lisbon in turn 1, Porto in turn 2): each
    call the dev model makes gets the result recorded for that city, whatever the ids are; with
    `given` the history keeps `call_0`, with `format` it reads `functions.get_weather:{idx}`."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": list(CITY_RESULTS)}},
                    "required": ["city"],
                },
            },
        }
    ]

    def turn(city: str) -> list[dict]:
        return [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": CITY_RESULTS[city]},
            {"role": "assistant", "content": f"{city} noted."},
        ]

    rows = [
        {
            "id": f"trip-{k}",
            "tools": tools,
            "messages": [
                {"role": "user", "content": f"Weather in Lisbon? ({k})"},
                *turn("Lisbon"),
                {"role": "user", "content": f"And in Porto? ({k})"},
                *turn("Porto"),
                {"role": "user", "content": "Thanks."},
            ],
        }
        for k in range(8)
    ]
    path = tmp_path / "reused.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_key = f"reused-{call_ids}"
    generated = _generate(
        store,
        s3_server,
        kimi_tokenizer_dir,
        tmp_path,
        monkeypatch,
        run_key,
        "--regenerate",
        "trajectory",
        prompts=path,
        call_ids=call_ids,
    )
    history_ids = {
        m["tool_call_id"]
        for p in store.read_table(StageRef(run_key, "prompts", "chat")).to_pylist()
        for m in json.loads(p["messages"])
        if m["role"] == "tool"
    }
    assert history_ids == (
        {"call_0"} if call_ids == "given" else {"functions.get_weather:0", "functions.get_weather:1"}
    )
    params = store.read_manifest(StageRef(run_key, "prompts", "chat"))["params"]
    assert params.get("call_ids") == (None if call_ids == "format" else "given")  # a switch is never a stale reuse
    spliced = Counter()
    for r in generated:
        messages = json.loads(r["messages"])
        for j, m in enumerate(messages):
            if m["role"] == "tool" and messages[j - 1].get("reasoning_content"):  # after a generated turn: spliced
                call = next(c for c in messages[j - 1]["tool_calls"] if c["id"] == m["tool_call_id"])
                city = json.loads(call["function"]["arguments"])["city"]
                assert m["content"] == CITY_RESULTS[city], (r["sample_id"], call)
                spliced[city] += 1
    assert spliced["Lisbon"] and spliced["Porto"], spliced  # both cities were called and answered


def test_a_trajectory_cut_at_reconstruct_keeps_its_turns_before_the_cut(
    store, start_dev_server, kimi_tokenizer, kimi_tokenizer_dir, tmp_path
):
    """The overflow path, its stages as the DAG runs them (generation in rounds, reconstruct,
    the merge with `trajectory_folds_of`), on a dev server that cuts every answer to a tool
    result (`cut_after_tool_result`): a length cut with tools offered, which the generation
    stage keeps (`ok`, the trajectory ends `length`) and the reconstruct stage marks
    unreconstructable. Each trajectory that got a tool result is then kept up to its turn before
    the cut: its record is the template's render of that turn's prompt plus its ids
    (tests/conversation_oracle.py), none is lost, and the merge manifest's counts add up."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import MergeConfig, load_config
    from eagle3_data.conversations import TurnDriver
    from eagle3_data.runs.run import Run
    from eagle3_data.runs.upstream import merged_shards
    from eagle3_data.stages.merge.datasets import MergeContext, merge_datasets
    from eagle3_data.stages.merge.stage import trajectory_folds_of
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts
    from eagle3_data.stages.reconstruct.stage import reconstruct
    from tests.conversation_oracle import check_conversation_records, stage_rows
    from tests.generation_calls import MODEL, generate_overflow

    server = start_dev_server({"endpoints": {"chat": {"cut_after_tool_result": 6}}})
    sampling = {"temperature": 0.0, "max_new_tokens": 160}
    rows = list(
        load_prompts(
            str(CONVERSATIONS), "chat", PromptShape(sampling=sampling, regenerate="trajectory", history="dataset")
        ).rows
    )
    config = load_config().with_overrides({"tokenizer": {"source": str(kimi_tokenizer_dir)}}, where="test")
    run = Run(
        config=config, run_key="cut-trajectories", date=None, datasets=["chat"], dry_run=False, skip_hidden_states=True
    )
    ref = StageRef(run.run_key, "generate_overflow", "chat")
    done = generate_overflow(
        store,
        ref,
        rows,
        kimi_tokenizer,
        server.url + "/v1",
        "sk-test",
        MODEL,
        {},
        None,
        sampling={**sampling, "thinking": True},
        concurrency=2,
        rows_per_part=4,
        journal_dir=tmp_path / "j",
        turns=TurnDriver("trajectory", "dataset", get_output_format(kimi_tokenizer, thinking=True)),
    )
    assert done["complete"], done
    reconstruct(run, store, "chat")
    rebuilt = stage_rows(store, run.run_key, "reconstruct", "chat")
    samples = read_samples(store.get_bytes(ref, SAMPLES_FILE))
    cut = [s for s in samples if len(s["steps"]) > 1 and rebuilt[s["steps"][-1]]["status"] == "unreconstructable"]
    assert cut and all(s["end"] == "length" for s in cut)  # the fault is exercised: answers to tool results cut
    summary = merge_datasets(
        store,
        [StageRef(run.run_key, "reconstruct", "chat")],
        run.run_key,
        MergeConfig(max_length=1 << 16, draft_vocab_size=64),
        context=MergeContext(folds=trajectory_folds_of(run, store, ["chat"])),
        vocab_size=len(kimi_tokenizer),
    )
    counts = check_conversation_records(store, run.run_key, "chat", kimi_tokenizer)  # every record the oracle's
    records = {}
    for shard in merged_shards(store, StageRef(run.run_key, "merge", "all")):
        records.update(
            {
                r["sample_id"]: r
                for r in pq.read_table(
                    io.BytesIO(store.get_bytes(StageRef(run.run_key, "merge", "all"), shard["name"]))
                ).to_pylist()
            }
        )
    usable = [s for s in samples if s["steps"] and rebuilt[s["steps"][0]]["status"] == "ok"]
    assert set(records) == {s["sample_id"] for s in usable} and counts["openrouter"] == len(usable)  # none lost
    for s in cut:
        end = json.loads(records[s["sample_id"]]["provenance"])["trajectory"]
        assert end["end"] == "cut_unreconstructable" and end["turns"] == len(s["steps"]) - 1, end
        assert "truncated" in end["cut_error"]
    st = Counter(summary["datasets"]["chat"])
    print("trajectory merge counts", json.dumps({k: v for k, v in st.items() if k.startswith("trajectory")}))
    assert (
        st["trajectory_samples"]
        == len(samples)
        == (
            st["trajectory_samples_whole"]
            + st["trajectory_samples_cut"]
            + st["trajectory_samples_dropped"]
            + st["trajectory_samples_unfolded"]
        )
    )
    assert st["trajectory_samples_cut"] == st["trajectory_cut_unreconstructable"] == len(cut)
    assert (
        st["trajectory_turns"]
        == sum(len(s["steps"]) for s in samples)
        == (st["trajectory_turns_folded"] + st["trajectory_turns_record"] + st["trajectory_turns_dropped"])
    )
    assert st["trajectory_turns_record"] == st["samples"] == len(records)


@pytest.mark.parametrize("path", ["local", "overflow"])
def test_samples_file_from_the_rows_prompt_ids_equals_the_render(
    path, store, start_dev_server, kimi_tokenizer, tmp_path, monkeypatch
):
    """The samples file is built from the turn rows' own prompt ids, read once as each row is
    observed (no second render of every turn's prompt at the end of the stage): it is byte for
    byte the file the template's render of every turn's prompt gives (`_rendered`, what a
    resumed stage still does for rows committed before it started). It is written a batch of
    rows at a time (a row group each), with the same rows and figures as one batch."""
    from eagle3_data import conversations
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.conversations import TurnDriver
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts
    from tests.generation_calls import MODEL, generate_local, generate_overflow

    server = start_dev_server({})
    sampling = {"temperature": 0.0, "max_new_tokens": 96}
    rows = list(
        load_prompts(
            str(CONVERSATIONS), "chat", PromptShape(sampling=sampling, regenerate="trajectory", history="regenerated")
        ).rows
    )
    driver = TurnDriver("trajectory", "regenerated", get_output_format(kimi_tokenizer, thinking=True))
    ref = StageRef(f"samples-from-rows-{path}", f"generate_{path}", "chat")
    common = {"rows_per_part": 4, "journal_dir": tmp_path / "j", "turns": driver}
    if path == "local":
        done = generate_local(
            store,
            ref,
            [dict(r, route="local") for r in rows],
            kimi_tokenizer,
            [server.url],
            {**sampling, "thinking": True},
            **common,
        )
    else:
        done = generate_overflow(
            store,
            ref,
            rows,
            kimi_tokenizer,
            server.url + "/v1",
            "sk-test",
            MODEL,
            {},
            None,
            sampling={**sampling, "thinking": True},
            concurrency=2,
            **common,
        )
    assert done["complete"], done
    fast = store.get_bytes(ref, conversations.SAMPLES_FILE)
    samples = read_samples(fast)
    chained = [s for s in samples if len(s["steps"]) > 1]
    assert chained and all(sid in driver._pairs for s in chained for sid in s["steps"][1:])  # no render needed
    if path == "local":
        assert sum(s["exact_turns"] or 0 for s in chained) > 0
    # written a batch of rows at a time: the same rows and figures however few a batch holds. The
    # reference is the stage's one-batch file, read back by pyarrow: its rows are held to the
    # template's render below (`rendered == fast`), its counts to the rows here.
    figures = store.read_manifest(ref)["extra"]["conversations"]
    assert figures["samples"] == len(samples) and figures["turns"] == sum(len(s["steps"]) for s in samples)
    with monkeypatch.context() as m:
        m.setattr(conversations, "SAMPLES_BATCH", 1)
        batched, batched_figures = driver.samples_file()
    assert pq.ParquetFile(io.BytesIO(batched)).num_row_groups == len(samples) > 1
    assert read_samples(batched) == samples and batched_figures == figures
    driver._pairs.clear()  # every sample rendered, as before
    rendered, _ = driver.samples_file()
    assert rendered == fast
