"""What a conversation sample must be, computed from the real Kimi template (the tokenizer's
`apply_chat_template`) and the turns' rows, independently of conversations and the
merge: the tests compare the merged records with it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq

CONVERSATIONS = Path(__file__).resolve().parents[1] / "include" / "sample_data" / "conversations.jsonl"
IM_END = 163586  # <|im_end|> (the id the story's 163533 is not)


def render(tok, messages, tools, thinking=True) -> list[int]:
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False, thinking=thinking
    )


def expected_record(tok, turns: list[dict], final_output: list[int], thinking=True) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a sample made of `turns` (generation rows in order, each with its
    `messages` and `tools`): the last turn's prompt as the template renders it, then
    `final_output` (the last turn's ids: the engine's, or the reconstruction's); mask 1 on each
    earlier turn's answer as rendered in the prompt after it (up to its <|im_end|>) and on the
    final output, 0 elsewhere. Checks that the turns' prompts chain, each starting with the one
    before it."""
    prompts = [
        render(tok, json.loads(t["messages"]), json.loads(t["tools"]) if t["tools"] else None, thinking) for t in turns
    ]
    ids = prompts[-1] + list(final_output)
    mask = [0] * len(ids)
    for j, prompt in enumerate(prompts):
        start = len(prompt)
        if j + 1 < len(prompts):
            assert prompts[j + 1][:start] == prompt, "a turn's prompt does not start with the one before it"
            end = prompts[j + 1].index(IM_END, start) + 1
        else:
            end = start + len(final_output)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def stage_rows(store, run_key: str, stage: str, dataset: str) -> dict[str, dict]:
    from eagle3_data.storage import StageRef

    ref = StageRef(run_key, stage, dataset)
    if not store.is_complete(ref):
        return {}
    return {r["sample_id"]: r for b in store.iter_batches(ref) for r in b.to_pylist()}


def check_conversation_records(store, run_key: str, dataset: str, tok, thinking: bool = True) -> dict:
    """Every merged record of `dataset` against the template's render at each of its turns
    (tests/conversation_oracle.py): a record of a sample made in rounds from its turns' rows, any
    other from its own row. Returns the records' count per source and the samples' figures."""
    from eagle3_data.conversations import SAMPLES_FILE, read_samples
    from eagle3_data.runs.upstream import merged_shards
    from eagle3_data.storage import StageRef

    sides = {}
    for stage, ids_stage, sources in (
        ("generate_local", "generate_local", ("sglang", "vllm")),
        ("generate_overflow", "reconstruct", ("openrouter",)),
    ):
        ref = StageRef(run_key, stage, dataset)
        names = {f["name"] for f in store.read_manifest(ref)["files"]} if store.is_complete(ref) else set()
        samples = read_samples(store.get_bytes(ref, SAMPLES_FILE)) if SAMPLES_FILE in names else []
        side = (
            stage_rows(store, run_key, stage, dataset),
            stage_rows(store, run_key, ids_stage, dataset),
            {s["sample_id"]: s for s in samples},
        )
        sides.update(dict.fromkeys(sources, side))  # one read of the stage for each engine's name
    merge_ref = StageRef(run_key, "merge", "all")
    max_length = store.read_manifest(merge_ref)["params"]["max_length"]
    counts: dict[str, int] = {}
    for shard in merged_shards(store, merge_ref):
        for rec in _shard_rows(store, merge_ref, shard["name"]):
            if rec["dataset"] != dataset:
                continue
            rows, ids_rows, samples = sides[rec["source"]]
            sample = samples.get(rec["sample_id"])
            steps = sample["steps"] if sample else [rec["sample_id"]]
            # a sample is its turns up to the first one whose ids the merge cannot use (not ok in the ids' stage)
            steps = steps[: next((j for j, sid in enumerate(steps) if ids_rows[sid]["status"] != "ok"), len(steps))]
            turns = [rows[sid] for sid in steps]
            ids, mask = expected_record(tok, turns, ids_rows[steps[-1]]["output_ids"], thinking)
            assert rec["truncated"] == (len(ids) > max_length)
            assert rec["input_ids"] == ids[:max_length], rec["sample_id"]
            assert rec["loss_mask"] == mask[:max_length], rec["sample_id"]
            assert rec["output_tokens"] == sum(mask[:max_length])
            counts[rec["source"]] = counts.get(rec["source"], 0) + 1
            counts["multi_turn"] = counts.get("multi_turn", 0) + (len(steps) > 1)
    return counts


def _shard_rows(store, ref, name: str) -> list[dict]:
    return pq.read_table(io.BytesIO(store.get_bytes(ref, name))).to_pylist()


def check_spliced_results(store, run_key: str, dataset: str) -> int:
    """Every tool result spliced into a trajectory's turns is the one its prompt row recorded for
    that call: the tool message answering a generated call (by its id within the assistant message
    right before it) holds a result the row recorded for a call of the same name and JSON-equal
    arguments. Returns how many results were checked (each turn's prompt repeats the ones before)."""
    from collections import defaultdict

    from eagle3_data.conversations import SAMPLES_FILE, read_samples
    from eagle3_data.storage import StageRef

    def key(call: dict) -> tuple[str, str]:
        return call["function"]["name"], json.dumps(json.loads(call["function"]["arguments"]), sort_keys=True)

    def answered(messages: list[dict]):
        calls: dict[str, tuple[str, str]] = {}
        for m in messages:
            if m["role"] == "assistant":
                calls = {c["id"]: key(c) for c in m.get("tool_calls") or ()}
            elif m["role"] == "tool":
                yield calls[m["tool_call_id"]], m["content"]

    prompts = stage_rows(store, run_key, "prompts", dataset)
    checked = 0
    for stage in ("generate_local", "generate_overflow"):
        ref = StageRef(run_key, stage, dataset)
        if not store.is_complete(ref):
            continue
        rows = stage_rows(store, run_key, stage, dataset)
        for s in read_samples(store.get_bytes(ref, SAMPLES_FILE)):
            recorded = defaultdict(list)
            for call, result in answered(json.loads(prompts[s["conversation"]]["messages"])):
                recorded[call].append(result)
            for sid in s["steps"]:
                for call, result in answered(json.loads(rows[sid]["messages"])):
                    assert result in recorded[call], (sid, call, result, dict(recorded))
                    checked += 1
    return checked
