"""Merge: ids/mask alignment, length policies, dedupe preference, failures, shuffle, shards (real S3)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_data.config import MergeConfig, load_config
from eagle3_data.conversations import trajectory_folds
from eagle3_data.errors import UserError
from eagle3_data.runs.upstream import merged_shards
from eagle3_data.stages.merge.datasets import MergeContext, build_record, merge_datasets, merge_params
from eagle3_data.storage import IncompleteStage, StageRef
from eagle3_data.storage.writer import StageWriter
from tests.fixtures.kimi import IM_END, VOCAB_SIZE


def gen_row(sid, dataset, source, prompt, output, status="ok", finish="stop"):
    return {
        "sample_id": sid,
        "dataset": dataset,
        "messages": "[]",
        "tools": None,
        "prompt_ids": prompt,
        "output_ids": output,
        "source": source,
        "status": status,
        "error": None if status == "ok" else "boom",
        "reasoning": None,
        "content": None,
        "tool_calls": None,
        "finish_reason": finish,
        "usage": None,
        "provenance": json.dumps({"model": "tiny", "source": source}),
    }


def write_stage(store, ref, rows):
    with StageWriter(store, ref, "generations", rows_per_part=7, tokenizer_sha256="tok", template_sha256="tpl") as w:
        w.write(rows)
        w.commit()


def read_all(store, summary, tmp_path):
    rows = []
    for shard in summary["shards"]:
        path = store.get_file(
            StageRef(shard["run_key"], shard["stage"], shard["dataset"]), shard["name"], tmp_path / shard["name"]
        )
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def test_ids_and_mask_line_up_exactly():
    prompt, output = [163587, 5, 6, 163601, 163588, 7, 163601, 163606], [10, 11, 163607, 12, IM_END]
    rec, reason = build_record(
        {
            "sample_id": "a",
            "dataset": "d",
            "source": "sglang",
            "prompt_ids": prompt,
            "output_ids": output,
            "finish_reason": "stop",
            "provenance": "{}",
        },
        max_length=100,
        length_policy="truncate",
    )
    assert reason is None
    assert rec["input_ids"] == prompt + output and len(rec["loss_mask"]) == len(rec["input_ids"])
    # unshifted: mask[t] == 1 exactly where input_ids[t] is a generated token, <|im_end|> included
    assert [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m] == output
    assert rec["loss_mask"][len(prompt) - 1] == 0 and rec["loss_mask"][len(prompt)] == 1
    assert rec["loss_mask"][-1] == 1 and rec["input_ids"][-1] == IM_END
    assert (rec["prompt_tokens"], rec["output_tokens"], rec["truncated"]) == (8, 5, False)


def test_length_policies():
    row = {
        "sample_id": "a",
        "dataset": "d",
        "source": "sglang",
        "prompt_ids": [1] * 6,
        "output_ids": [2] * 6,
        "finish_reason": "length",
        "provenance": "{}",
    }
    rec, _ = build_record(row, max_length=8, length_policy="truncate")
    assert rec["input_ids"] == [1] * 6 + [2] * 2 and rec["loss_mask"] == [0] * 6 + [1] * 2
    assert rec["truncated"] and rec["output_tokens"] == 2
    assert build_record(row, max_length=8, length_policy="drop") == (None, "too_long")
    assert build_record(row, max_length=6, length_policy="truncate") == (None, "prompt_too_long")
    assert build_record({**row, "output_ids": []}, max_length=80, length_policy="truncate") == (None, "empty_output")


@pytest.fixture
def two_datasets(store):
    local = StageRef("date=2026-11-29", "generate_local", "chat")
    overflow = StageRef("date=2026-11-29", "reconstruct", "chat")
    tools = StageRef("date=2026-11-29", "generate_local", "tools")
    write_stage(
        store,
        local,
        [gen_row(f"c{i}", "chat", "sglang", [100 + i] * 5, [7] * (3 + i % 4)) for i in range(20)]
        + [gen_row("c-fail", "chat", "sglang", None, None, status="failed")],
    )
    # c0..c4 also came back from OpenRouter (calibration overlap): the local ground truth must win
    write_stage(
        store,
        overflow,
        [gen_row(f"c{i}", "chat", "openrouter", [100 + i] * 5, [9] * 4) for i in range(5)]
        + [gen_row(f"o{i}", "chat", "openrouter", [200 + i] * 4, [8] * 30) for i in range(6)]
        + [gen_row("o-fail", "chat", "openrouter", None, None, status="failed")]
        + [gen_row("o-cut", "chat", "openrouter", [201] * 3, [8] * 2, status="unreconstructable")],
    )
    write_stage(store, tools, [gen_row(f"t{i}", "tools", "sglang", [300 + i] * 3, [6] * 5) for i in range(15)])
    return [local, overflow, tools]


def test_merge_dedupes_counts_and_shards(store, two_datasets, tmp_path):
    summary = merge_datasets(
        store,
        two_datasets,
        "date=2026-11-29",
        MergeConfig(max_length=20, length_policy="drop", shard_tokens=100, seed=1),
        context=MergeContext(tokens_per_bucket=40),
        vocab_size=VOCAB_SIZE,
    )
    rows = read_all(store, summary, tmp_path)
    by_id = {r["sample_id"]: r for r in rows}
    assert len(by_id) == len(rows) == 20 + 15  # o* are 34 tokens > 20: dropped; c0..c4 deduped
    assert all(by_id[f"c{i}"]["source"] == "sglang" and 9 not in by_id[f"c{i}"]["input_ids"] for i in range(5))
    chat, tools = summary["datasets"]["chat"], summary["datasets"]["tools"]
    assert chat["duplicates"] == 5 and chat["dropped_too_long"] == 6
    assert chat["failed_sglang"] == 1 and chat["failed_openrouter"] == 1 and chat["unreconstructable_openrouter"] == 1
    assert "o-cut" not in by_id  # short enough to be kept, but its text could not determine its ids
    assert chat["samples"] == 20 and tools["samples"] == 15
    assert chat["tokens"] == sum(len(by_id[f"c{i}"]["input_ids"]) for i in range(20))
    assert tools["loss_tokens"] == 15 * 5
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == r["prompt_tokens"] + r["output_tokens"]
    # shards close once they reach the token target, and the manifest lists them
    assert len(summary["shards"]) > 1 and all(s["tokens"] >= 100 for s in summary["shards"][:-1])
    assert merged_shards(store, StageRef("date=2026-11-29", "merge", "all")) == summary["shards"]
    manifest = store.read_manifest(StageRef("date=2026-11-29", "merge", "all"))
    assert manifest["tokenizer_sha256"] == "tok" and manifest["params"]["seed"] == 1


def test_the_draft_vocabulary_counts_the_merged_rows_trained_tokens(store, two_datasets, tmp_path):
    import numpy as np

    summary = merge_datasets(
        store,
        two_datasets,
        "vocab",
        MergeConfig(max_length=64, shard_tokens=100, draft_vocab_size=3),
        vocab_size=VOCAB_SIZE,
    )
    rows = read_all(store, summary, tmp_path)
    trained = [t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
    counts = np.bincount(trained, minlength=VOCAB_SIZE)
    top = sorted(range(VOCAB_SIZE), key=lambda t: (-counts[t], t))[:3]
    ref = StageRef("vocab", "merge", "all")
    vocab = store.read_manifest(ref)["extra"]["draft_vocab"]
    assert vocab["size"] == 3 and vocab["trained_tokens"] == len(trained)
    assert vocab["coverage"] == pytest.approx(sum(counts[top]) / len(trained))
    d2t = np.load(store.get_file(ref, "d2t-3.npy", tmp_path / "d2t.npy"))
    assert (d2t + np.arange(3)).tolist() == sorted(top)
    # one entry per target id, as speculators' load_vocab_mappings and SpecForge's t2d buffer require
    t2d = np.load(store.get_file(ref, "t2d-3.npy", tmp_path / "t2d.npy"))
    assert t2d.shape == (VOCAB_SIZE,) and np.flatnonzero(t2d).tolist() == sorted(top)
    assert set(vocab["files"]) == {"token_freq.pt", "d2t-3.npy", "t2d-3.npy", "vocab_mapping-3.pt"}


def test_shuffle_is_seeded_and_independent_of_bucketing(store, two_datasets, tmp_path):
    def order(seed, tokens_per_bucket, run):
        s = merge_datasets(
            store,
            two_datasets,
            run,
            MergeConfig(max_length=64, shard_tokens=10_000, seed=seed),
            context=MergeContext(tokens_per_bucket=tokens_per_bucket),
            vocab_size=VOCAB_SIZE,
        )
        return [r["sample_id"] for r in read_all(store, s, tmp_path)]

    a = order(3, 30, "r1")
    assert a == order(3, 1000, "r2")  # many buckets or one: same global order
    assert a != order(4, 30, "r3")
    assert sorted(a) == sorted(order(4, 30, "r3"))
    assert a != sorted(a)


def test_a_key_added_to_the_merge_section_is_in_the_params_so_reuse_sees_it(store, two_datasets):
    """The manifest's params are the whole `merge` section (pydantic's own dump is the oracle):
    a key added to it needs no list kept in step, and a merge made under another value of it is
    not reused (runs.reuse compares the params)."""
    from eagle3_data.runs.reuse import reusable

    class Wider(MergeConfig):  # the section as it would be with one more key
        new_knob: int = 3

    merge_datasets(store, two_datasets, "wider", Wider(max_length=64), vocab_size=VOCAB_SIZE)
    ref = StageRef("wider", "merge", "all")
    assert store.read_manifest(ref)["params"] == Wider(max_length=64).model_dump(mode="json")
    assert reusable(store, ref, two_datasets, merge_params(Wider(max_length=64))) is not None
    assert reusable(store, ref, two_datasets, merge_params(Wider(max_length=64, new_knob=4))) is None
    assert reusable(store, ref, two_datasets, merge_params(MergeConfig(max_length=64))) is None


def test_bad_rows_and_incomplete_inputs_are_user_errors(store):
    ref = StageRef("r", "generate_local", "bad")
    write_stage(store, ref, [gen_row("x1", "bad", "sglang", [1, 2], None)])
    with pytest.raises(UserError, match="sample x1: field output_ids"):
        merge_datasets(store, [ref], "r", vocab_size=VOCAB_SIZE)
    with pytest.raises(IncompleteStage):
        merge_datasets(store, [StageRef("r", "generate_local", "missing")], "r", vocab_size=VOCAB_SIZE)
    with pytest.raises(UserError, match="length_policy"):
        load_config().with_overrides({"merge": {"length_policy": "clip"}})  # the merge's settings are validated there


def test_merge_refuses_ids_outside_the_vocabulary_naming_the_sample(store):
    ref = StageRef("r", "generate_local", "oov")
    write_stage(
        store,
        ref,
        [gen_row("ok1", "oov", "sglang", [1, 2], [3, IM_END]), gen_row("x9", "oov", "sglang", [1, 2], [3, VOCAB_SIZE])],
    )
    with pytest.raises(
        UserError, match=r"sample x9: field output_ids holds id 163840, outside the vocabulary \(0..163839\)"
    ):
        merge_datasets(store, [ref], "r", vocab_size=VOCAB_SIZE)


@pytest.mark.parametrize("max_length", [4096, 9])
def test_trajectory_folds_make_one_record_with_the_tool_results_unmasked(store, tmp_path, max_length):
    """A two-turn trajectory: turn 1's row is folded away, turn 2's row becomes the record: the
    first prompt (mask 0), turn 1's answer (1), the tool result and header (0), turn 2's output
    (1). The columnar path equals build_record, also when max_length cuts inside a masked span;
    rows outside the folds are merged as they are."""
    p1, a1, tool, p2_tail, out2 = [1, 2, 3], [10, 11, IM_END], [20, 21], [22], [30, IM_END]
    p2 = p1 + a1 + tool + p2_tail
    rows = [
        gen_row("turn1", "d", "sglang", p1, a1),
        gen_row("turn2", "d", "sglang", p2, out2),
        gen_row("plain", "d", "sglang", [5, 6], [7, IM_END]),
    ]
    ref = StageRef("r-fold", "generate_local", "d")
    write_stage(store, ref, rows)
    folds = {
        ref: trajectory_folds(
            [
                {
                    "sample_id": "traj",
                    "steps": ["turn1", "turn2"],
                    "prefix_ok": True,
                    "base": 3,
                    "masked": [3, 6],
                    "end": "answered",
                }
            ]
        )
    }
    # a max_length under the config's bound (16): the section built without its validation
    config = MergeConfig.model_construct(max_length=max_length, draft_vocab_size=8)
    summary = merge_datasets(
        store, [ref], "r-fold-out", config, context=MergeContext(folds=folds), vocab_size=VOCAB_SIZE
    )
    records = {r["sample_id"]: r for r in read_all(store, summary, tmp_path)}
    assert set(records) == {"traj", "plain"}
    traj = records["traj"]
    assert traj["input_ids"] == (p2 + out2)[:max_length]
    assert traj["loss_mask"] == ([0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1])[:max_length]
    assert traj["output_tokens"] == sum(traj["loss_mask"]) and traj["prompt_tokens"] == 3
    expected, _ = build_record(
        {
            **rows[1],
            "sample_id": "traj",
            "prompt_ids": p1,
            "output_ids": p2[3:] + out2,
            "masked": [3, 6],
            "provenance": traj["provenance"],
        },
        max_length,
        "truncate",
    )
    assert {k: traj[k] for k in expected} == expected
    assert json.loads(traj["provenance"]) == {
        **json.loads(rows[1]["provenance"]),
        "turn_id": "turn2",
        "trajectory": {"turns": 2, "generated_turns": 2, "end": "answered"},
    }
    assert records["plain"]["loss_mask"] == [0, 0, 1, 1]
    stats = summary["datasets"]["d"]
    assert stats["trajectory_turns_folded"] == 1 and stats["loss_tokens"] == sum(traj["loss_mask"]) + 2


def test_a_trajectory_whose_last_turn_is_unusable_keeps_its_usable_turns(store, tmp_path):
    """Hand-built turns, the expected records written out token by token. `cut`: three turns, the
    third unreconstructable (a length cut with tools offered, found at reconstruct): the record is
    turn 2's prompt + output, mask 1 on turn 1's answer and turn 2's output, 0 on the first
    prompt and the tool result between them. `mid`: turn 2 answered by another model: the record
    is turn 1 alone, turn 3 (whose prompt holds that answer) dropped. `lost`: its one turn
    unusable: dropped. `whole`: two usable turns, one record. Every sample and turn row is
    counted once, and the counts add up."""
    t1 = [1, 2, 3]
    a1 = [10, 11, IM_END]
    t2 = t1 + a1 + [20, 21]  # + the tool result and the next header
    a2 = [12, 13, IM_END]
    t3 = t2 + a2 + [22, 23]
    rows = [
        gen_row("c1", "d", "openrouter", t1, a1, finish="tool_calls"),
        gen_row("c2", "d", "openrouter", t2, a2, finish="tool_calls"),
        gen_row("c3", "d", "openrouter", t3, [14, 15], status="unreconstructable", finish="length"),
        gen_row("m1", "d", "openrouter", t1, a1, finish="tool_calls"),
        gen_row("m2", "d", "openrouter", t2, a2, status="identity_mismatch"),
        gen_row("m3", "d", "openrouter", [4] + t3[1:], [16, IM_END]),
        gen_row("l1", "d", "openrouter", [7, 8], [9], status="unreconstructable", finish="length"),
        gen_row("w1", "d", "openrouter", t1, a1, finish="tool_calls"),
        gen_row("w2", "d", "openrouter", t2, a2),
    ]
    ref = StageRef("r-cut", "reconstruct", "d")
    write_stage(store, ref, rows)
    masked = [3, 5, 8, 10]  # after the first prompt: turn 1's tool result, turn 2's
    samples = [
        {"sample_id": "cut", "steps": ["c1", "c2", "c3"], "end": "length"},
        {"sample_id": "mid", "steps": ["m1", "m2", "m3"], "end": "answered"},
        {"sample_id": "lost", "steps": ["l1"], "end": "length"},
        {"sample_id": "whole", "steps": ["w1", "w2"], "end": "answered"},
    ]
    samples = [{**s, "prefix_ok": True, "base": 3, "masked": masked[: 2 * len(s["steps"]) - 2]} for s in samples]
    folds = {ref: trajectory_folds(samples, {r["sample_id"]: (r["status"], r["error"]) for r in rows})}
    summary = merge_datasets(
        store,
        [ref],
        "r-cut-out",
        MergeConfig(draft_vocab_size=8),
        context=MergeContext(folds=folds),
        vocab_size=VOCAB_SIZE,
    )
    records = {r["sample_id"]: r for r in read_all(store, summary, tmp_path)}
    assert sorted(records) == ["cut", "mid", "whole"]
    assert records["cut"]["input_ids"] == [1, 2, 3, 10, 11, IM_END, 20, 21, 12, 13, IM_END]
    assert records["cut"]["loss_mask"] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert records["whole"]["input_ids"] == records["cut"]["input_ids"]
    assert records["mid"]["input_ids"] == [1, 2, 3, 10, 11, IM_END] and records["mid"]["loss_mask"] == [
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    ends = {sid: json.loads(r["provenance"])["trajectory"] for sid, r in records.items()}
    assert ends["cut"] == {
        "turns": 2,
        "generated_turns": 3,
        "end": "cut_unreconstructable",
        "cut_by": "c3",
        "cut_error": "boom",
    }
    assert ends["mid"]["end"] == "cut_identity_mismatch" and ends["whole"] == {
        "turns": 2,
        "generated_turns": 2,
        "end": "answered",
    }
    st = summary["datasets"]["d"]
    assert (
        st["trajectory_samples"],
        st["trajectory_samples_whole"],
        st["trajectory_samples_cut"],
        st["trajectory_samples_dropped"],
    ) == (4, 1, 2, 1)
    assert (
        st["trajectory_cut_unreconstructable"],
        st["trajectory_cut_identity_mismatch"],
        st["trajectory_dropped_unreconstructable"],
    ) == (1, 1, 1)
    # turn rows: c1, w1 folded; c2, m1, w2 records; c3, m2, m3, l1 dropped
    assert (
        st["trajectory_turns"],
        st["trajectory_turns_folded"],
        st["trajectory_turns_record"],
        st["trajectory_turns_dropped"],
    ) == (9, 2, 3, 4)
    assert st["samples"] == 3
