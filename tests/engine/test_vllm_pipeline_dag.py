"""The real DAG end to end on the real engine: `generation.local.engine: vllm` (config) and
`hidden_states.backend: vllm` (the run's `hidden_states_backend` param), through `dag.test()`
against SeaweedFS and the tiny Kimi-K2.5 (`model.source`, `hidden_states.max_images`: the session's).

Local generation runs on the session's `vllm serve` (the `vllm_server` fixture, wired in as the
`sglang_default` connection: the local-engine connection is engine-neutral); overflow still goes
to the dev inference server (the OpenRouter stand-in). Extraction runs in the DAG's own process
(`dag.test()` runs tasks in-process) on the session's vLLM extraction engine: the config asks for
exactly the engine the other tests use (the tiny Kimi-K2.5, TP 1, `max_model_len` = merge.max_length
+ 1, `max_images` 2, output convention + last_hidden = vLLM ids [2, 4, 5, 8]), so `shared_backend`
hands the DAG that very engine and no second one starts.

Content, not just task states: the local rows are the engine's (source `vllm`, the prompt ids the
format renders, greedy ids equal to a second request of the same prompt), merged records are
exactly prompt + output ids of their source rows, and each stored state equals an independent
transformers forward (`Kimi_K25ForConditionalGeneration`, text alone) over the merged ids (bf16
storage: relative error < 1e-2).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest
import torch
from eagle3_airflow import DAG_ID

from eagle3_data.config import load_config
from tests.fixtures.airflow import dag_stack
from tests.fixtures.engine import MAX_IMAGES, MAX_MODEL_LEN

pytestmark = pytest.mark.slow

DATE = datetime(2026, 11, 2, tzinfo=timezone.utc)
RUN_KEY = "date=2026-11-02"
DATASETS = ("code",)  # one mapped dataset: the multi-dataset DAG is tests/dags/test_e2e.py's
SAMPLES = 4  # prompts per dataset
MAX_NEW = 16  # a random model never stops: every local row is a `length` cut of MAX_NEW ids
OVERRIDES = {
    # the local engine is real here (vLLM): only the tokenizer, the model and OpenRouter are stand-ins
    "stand_ins": ["tokenizer", "model", "overflow_provider"],
    "generation": {
        "sampling": {"temperature": 0.0, "max_new_tokens": MAX_NEW},
        "local": {"engine": "vllm", "rows_per_part": 2, "warmup_timeout_s": 60},
    },
    "routing": {"overflow_fraction": 0.25, "calibration_samples": 1},
    # max_length + 1 == the session engine's max_model_len: the DAG reuses the tests' engine
    "merge": {"max_length": MAX_MODEL_LEN - 1, "shard_tokens": 256},
    # the config keeps the default backend (transformers): the run's `hidden_states_backend`
    # param selects vllm, so the trigger-form path is what this run exercises
    "hidden_states": {"last_hidden": True, "workers": 1, "max_images": MAX_IMAGES},
    # a random model's ids are often not the tokenizer's canonical split of their own text (a real
    # model's almost always are): bpe_only is measured and reported, not gated, here
    "validation": {"max_bpe_mismatch_rate": 1.0},
    "datasets": [{"name": name} for name in DATASETS],
}
H = 64  # the tiny model's hidden size


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory, airflow_db, vllm_server, vllm_backend, tiny_kimi_k25_dir):
    with dag_stack(
        tmp_path_factory.mktemp("dag-vllm"),
        DATASETS,
        SAMPLES,
        f"{DATE:%Y-%m-%d}",
        config_overrides={**OVERRIDES, "model": {"source": str(tiny_kimi_k25_dir)}},  # the engines' model
        extra_env={"AIRFLOW_CONN_SGLANG_DEFAULT": vllm_server.connection()},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def dag_run(vllm_stack):
    from airflow.dag_processing.dagbag import DagBag

    from tests.fixtures.airflow import REPO

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors
    return bag.dags[DAG_ID].test(logical_date=DATE, run_conf={"hidden_states_backend": "vllm"})


def _states(dag_run) -> dict[tuple[str, str], str]:
    from airflow.utils.session import create_session

    with create_session() as session:
        return {
            (ti.task_id, ti.rendered_map_index or str(ti.map_index)): str(ti.state)
            for ti in dag_run.get_task_instances(session=session)
        }


def test_dag_runs_on_vllm_for_generation_and_extraction(
    vllm_stack, dag_run, vllm_server, vllm_backend, kimi_tokenizer, tiny_kimi_k25_dir, tmp_path
):
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.exports.shards import ShardReader
    from eagle3_data.pipeline import open_store
    from eagle3_data.storage import StageRef

    states = _states(dag_run)
    assert str(dag_run.state).endswith("success"), states
    store = open_store(load_config(vllm_stack.config_path), vllm_stack.client())
    fmt = get_output_format(kimi_tokenizer, thinking=True)

    # local generation: the engine's rows, its prompt ids, its manifest
    local = {}
    for ds in DATASETS:
        ref = StageRef(RUN_KEY, "generate_local", ds)
        m = store.read_manifest(ref)
        assert m["params"]["source"] == "vllm"
        assert m["extra"]["engine"] == "vllm" and m["extra"]["served_models"] == {vllm_server.url: "tiny-kimi"}
        prompts = {r["sample_id"]: r for r in store.read_table(StageRef(RUN_KEY, "prompts", ds)).to_pylist()}
        rows = store.read_table(ref).to_pylist()
        assert rows and all(prompts[r["sample_id"]]["route"] in ("local", "both") for r in rows)
        for r in rows:
            p = prompts[r["sample_id"]]
            tools = json.loads(p["tools"]) if p["tools"] else None
            assert r["source"] == "vllm" and r["status"] == "ok"
            assert r["prompt_ids"] == fmt.generation_prompt_ids(json.loads(p["messages"]), tools)
            assert r["finish_reason"] == "length" and len(r["output_ids"]) == MAX_NEW
            local[r["sample_id"]] = r
        # the gate ran on the engine's own ids: every row classed once, as the engine's, none bad
        report = store.get_json(StageRef(RUN_KEY, "validate", ds), "report.json")
        assert report["run_gate"]["passed"], report["run_gate"]
        assert report["samples"] == len(rows) and not report["bad_rows"]
        assert report["stop_convention"]["stop_rows"] == 0  # length cuts only: no stop id to classify
        classed = store.read_table(StageRef(RUN_KEY, "validate", ds)).to_pylist()
        assert sorted(r["sample_id"] for r in classed) == sorted(r["sample_id"] for r in rows)
        assert {r["source"] for r in classed} == {"vllm"}
        assert Counter(r["class"] for r in classed) == Counter({k: v for k, v in report["counts"].items() if v})
        assert report["counts"]["wrong_stop"] == report["counts"]["text_diff"] == report["counts"]["special_token"] == 0
        assert all(r["output_tokens"] == MAX_NEW for r in classed)

    # greedy: the DAG's ids are what the engine gives for the same prompt now
    from tests.generation_calls import generate_vllm as generate_local

    some = sorted(local)[:2]
    again = StageRef("vllm-dag-check", "generate_local", "chat")
    prompt_rows = [
        r
        for ds in DATASETS
        for r in store.read_table(StageRef(RUN_KEY, "prompts", ds)).to_pylist()
        if r["sample_id"] in some
    ]
    generate_local(
        store,
        again,
        prompt_rows,
        kimi_tokenizer,
        [vllm_server.url],
        {"temperature": 0.0, "max_new_tokens": MAX_NEW, "thinking": True},
        journal_dir=tmp_path,
    )
    assert {r["sample_id"]: r["output_ids"] for r in store.read_table(again).to_pylist()} == {
        sid: local[sid]["output_ids"] for sid in some
    }

    # merge: both sources, each record exactly prompt + output ids of its source row
    merge_ref = StageRef(RUN_KEY, "merge", "all")
    merged_manifest = store.read_manifest(merge_ref)
    assert sorted(merged_manifest["extra"]["datasets"]) == sorted(DATASETS)
    merged = {}
    for f in merged_manifest["files"]:
        if f["name"].endswith(".parquet"):
            merged.update(
                {
                    r["sample_id"]: r
                    for r in pq.read_table(store.get_file(merge_ref, f["name"], tmp_path / f["name"])).to_pylist()
                }
            )
    sources = {r["source"] for r in merged.values()}
    assert sources == {"vllm", "openrouter"}, sources
    for sid, rec in merged.items():
        if rec["source"] == "vllm":
            assert rec["input_ids"] == local[sid]["prompt_ids"] + local[sid]["output_ids"]
            assert sum(rec["loss_mask"]) == MAX_NEW
    assert {sid for sid, r in merged.items() if r["source"] == "vllm"} == set(
        local
    )  # "both" rows: the engine's ids win

    # hidden states: every merged sample, from the session's engine, recorded as vllm
    hs_ref = StageRef(RUN_KEY, "hidden_states", "all")
    hs = store.read_manifest(hs_ref)
    assert hs["params"]["backend"] == hs["extra"]["backend"] == "vllm"
    assert hs["extra"]["engines"] == [vllm_backend.describe().engine] and hs["extra"]["engines"][0].startswith(
        "vllm 0.32.0"
    )
    assert hs["extra"]["totals"]["samples"] == len(merged) == merged_manifest["extra"]["totals"]["samples"]
    assert vllm_backend.starts == 1  # the DAG's extraction ran on the session's one engine
    stored = {}
    for f in hs["files"]:
        if f["name"].endswith(".safetensors"):
            reader = ShardReader(store.get_file(hs_ref, f["name"], tmp_path / f["name"]))
            assert (reader.metadata["backend"], reader.metadata["dtype"]) == ("vllm", "bfloat16")
            assert json.loads(reader.metadata["layer_ids"]) == [1, 3, 4]
            assert reader.last_hidden_norm == "pre" and hs["extra"]["last_hidden_norm"] == "pre"
            final_norm = reader.final_norm
            stored.update({s.sample_id: s for s in reader})
    assert set(stored) == set(merged)
    from transformers import Kimi_K25ForConditionalGeneration

    from eagle3_data.target_head.final_norm import rms_norm

    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_k25_dir), dtype=torch.float32).eval()
    for sid in sorted(stored)[:3] + [next(s for s in sorted(stored) if merged[s]["source"] == "openrouter")]:
        s, rec = stored[sid], merged[sid]
        n = len(rec["input_ids"])
        assert s.input_ids.tolist() == rec["input_ids"] and s.loss_mask.tolist() == rec["loss_mask"]
        assert s.aux_hidden_states.shape == (n, 3 * H) and s.aux_hidden_states.dtype == torch.bfloat16
        assert s.last_hidden_states.shape == (n, H)
        with torch.no_grad():
            ref = model.model(torch.tensor([rec["input_ids"]]), output_hidden_states=True).hidden_states
        aux = s.aux_hidden_states.float().reshape(n, 3, H)
        for j, index in enumerate([2, 4, 5]):  # output convention [1, 3, 4] = hidden_states[2, 4, 5]
            err = float((aux[:, j] - ref[index][0]).abs().max() / ref[index][0].abs().max())
            assert err < 1e-2, (sid, index, err)
        # stored before the final norm (the default); the norm recorded with the shard gives the model's own
        normed = rms_norm(s.last_hidden_states.float(), *final_norm)
        err = float((normed - ref[8][0]).abs().max() / ref[8][0].abs().max())
        assert err < 1e-2, (sid, "last", err)

    # publish: the run is announced with the vLLM extraction
    summary = store.get_json(StageRef(RUN_KEY, "publish", "all"), "summary.json")
    assert summary["hidden_states"]["totals"]["samples"] == len(merged)
    assert all(summary["datasets"][ds]["gate"]["passed"] for ds in DATASETS)


@pytest.mark.parametrize("mode,history", [("every_turn", "dataset"), ("trajectory", "regenerated")])
def test_conversations_run_through_the_dag_on_vllm(mode, history, vllm_stack, dag_run, tmp_path, kimi_tokenizer):
    """include/sample_data/conversations.jsonl through the DAG with vLLM as the local engine, in the
    modes `final_turn` (the test above) does not cover: `every_turn` (prompts known up front) and
    `trajectory` on the regenerated history (the stage runs in rounds). Every merged record equals
    the template's render at each of its turns (tests/conversation_oracle.py), on both paths. The
    random tiny model never calls a tool, so each trajectory is its first turn, cut at MAX_NEW
    (`length`), and a regenerated chain ends there: the figures say so."""
    import os
    from pathlib import Path

    import yaml
    from airflow.dag_processing.dagbag import DagBag

    from eagle3_data.pipeline import open_store
    from eagle3_data.storage import StageRef
    from eagle3_devtools.stack import upload_prompts
    from tests.conversation_oracle import CONVERSATIONS, check_conversation_records
    from tests.fixtures.airflow import REPO

    raw = yaml.safe_load(Path(vllm_stack.config_path).read_text())
    raw["datasets"].append({"name": "conversations"})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    upload_prompts(vllm_stack.client(), load_config(path), f"{DATE:%Y-%m-%d}", {"conversations": CONVERSATIONS})
    run_name = f"conv-vllm-{mode}".replace("_", "-")
    os.environ["EAGLE3_CONFIG"] = str(path)
    try:
        dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
        dr = dag.test(
            logical_date=DATE,
            run_conf={
                "run_name": run_name,
                "datasets": ["conversations"],
                "regenerate": mode,
                "history": history,
                "hidden_states_backend": "vllm",
                "skip_hidden_states": True,
            },
        )
    finally:
        os.environ["EAGLE3_CONFIG"] = str(vllm_stack.config_path)
    assert str(dr.state).endswith("success"), _states(dr)
    store = open_store(load_config(path), vllm_stack.client())
    counts = check_conversation_records(store, run_name, "conversations", kimi_tokenizer)
    assert counts.get("vllm") and counts.get("openrouter"), counts
    local = store.read_manifest(StageRef(run_name, "generate_local", "conversations"))
    assert local["params"]["source"] == "vllm"
    if mode == "every_turn":  # one sample per user turn of the 4 rows, on one path or the other
        generated = {
            sid
            for stage in ("generate_local", "generate_overflow")
            for b in store.iter_batches(StageRef(run_name, stage, "conversations"))
            for sid in b.column("sample_id").to_pylist()
        }
        assert len(generated) == 10 and "conversations" not in local["extra"]
        # merged: all but the overflow answers a cut tool section makes unreconstructable (MAX_NEW is small)
        assert counts["vllm"] + counts["openrouter"] <= 10
    else:
        figures = local["extra"]["conversations"]
        assert figures["mode"] == "trajectory/regenerated" and figures["samples"] == figures["turns"] == counts["vllm"]
        assert figures["end"] == {"length": figures["samples"]}


def test_image_prompts_run_through_the_dag_on_vllm(
    vllm_stack, dag_run, vllm_python, vllm_backend, tiny_kimi_k25_dir, tmp_path, kimi_tokenizer
):
    """include/sample_data/images.jsonl (every image layout) through the DAG with images sent to
    the local engine (`generation.local.images: true`) and extracted on vLLM: each generated row's
    prompt ids are what transformers' Kimi-K2.5 processor makes of its messages and images
    (tests/image_oracle.py), on both paths; the media tokens are never trained on; and each image
    sample's stored states equal transformers' own forward of the tiny Kimi-K2.5 over the merged
    ids with the same pixels (vLLM's image processor's, as in test_kimi_k25_images.py)."""
    import io
    import os
    from pathlib import Path

    import yaml
    from airflow.dag_processing.dagbag import DagBag

    from eagle3_data.exports.shards import ShardReader
    from eagle3_data.images import read_merged_images
    from eagle3_data.pipeline import open_store
    from eagle3_data.storage import StageRef
    from eagle3_devtools.stack import SAMPLE_DATA, upload_prompts
    from tests.fixtures.airflow import REPO
    from tests.image_oracle import check_image_sample_states, processor_ids

    raw = yaml.safe_load(Path(vllm_stack.config_path).read_text())
    raw["datasets"].append({"name": "images"})
    raw["generation"]["local"]["images"] = True  # the session's `vllm serve` takes images
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    upload_prompts(vllm_stack.client(), load_config(path), f"{DATE:%Y-%m-%d}", {"images": SAMPLE_DATA / "images.jsonl"})
    os.environ["EAGLE3_CONFIG"] = str(path)
    try:
        dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
        dr = dag.test(
            logical_date=DATE,
            run_conf={"run_name": "images-vllm", "datasets": ["images"], "hidden_states_backend": "vllm"},
        )
    finally:
        os.environ["EAGLE3_CONFIG"] = str(vllm_stack.config_path)
    assert str(dr.state).endswith("success"), _states(dr)
    store = open_store(load_config(path), vllm_stack.client())
    run = "images-vllm"

    # generation: the engine saw the images (source vllm) and our ids are the processor's
    sources = Counter()
    for stage in ("generate_local", "reconstruct"):
        for row in store.read_table(StageRef(run, stage, "images")).to_pylist():
            if row["status"] != "ok":
                continue
            refs = json.loads(row["images"])
            expected = processor_ids(
                kimi_tokenizer, json.loads(row["messages"]), [(r["width"], r["height"]) for r in refs]
            )
            assert list(row["prompt_ids"]) == expected, row["sample_id"]
            sources[row["source"]] += 1
    assert sources["vllm"] >= 1 and sources["openrouter"] >= 1, sources
    prompts = store.read_manifest(StageRef(run, "prompts", "images"))["extra"]["counts"]
    assert not prompts.get("images_to_overflow"), prompts  # routed as text prompts are
    # the policy check scored the answers with their images (the engine takes them), none refused
    policy = store.get_json(StageRef(run, "score_policy", "images"), "policy.json")
    assert policy["image_samples_left_out"] == {"local": 0, "overflow": 0} and "skipped" not in policy, policy
    assert policy["refused_count"] == 0 and policy["worst"]["overflow"], policy

    # merge: media tokens masked, references beside the shards
    pad = kimi_tokenizer.convert_tokens_to_ids("<|media_pad|>")
    merge = StageRef(run, "merge", "all")
    images = read_merged_images(store, merge)
    merged = {
        r["sample_id"]: r
        for s in store.read_manifest(merge)["extra"]["shards"]
        for r in pq.read_table(io.BytesIO(store.read_object(merge, s["name"]))).to_pylist()
    }
    assert merged and set(merged) <= set(images)
    assert {r["source"] for r in merged.values()} == {"vllm", "openrouter"}
    for r in merged.values():
        pads = [k for k, t in enumerate(r["input_ids"]) if t == pad]
        assert len(pads) == sum(i["media_tokens"] for i in images[r["sample_id"]]) > 0
        assert all(r["loss_mask"][k] == 0 for k in pads)

    # extraction: every image sample, none left out, each equal to transformers' forward with pixels
    hs_ref = StageRef(run, "hidden_states", "all")
    hs = store.read_manifest(hs_ref)
    assert hs["extra"]["backend"] == "vllm" and hs["extra"]["totals"]["left_out_image_samples"] == 0, hs["extra"]
    stored = {}
    for f in hs["files"]:
        if f["name"].endswith(".safetensors"):
            stored.update(
                {s.sample_id: s for s in ShardReader(store.get_file(hs_ref, f["name"], tmp_path / f["name"]))}
            )
    assert set(stored) == set(merged)
    assert vllm_backend.starts == 1  # the session's one extraction engine
    check_image_sample_states(store, vllm_python, tiny_kimi_k25_dir, merged, images, stored, [2, 4, 5], tmp_path)
