"""The `vllm` hidden-state backend against an independent transformers forward (fp32, CPU).

One engine for the whole session (`vllm_backend`, the tiny Kimi-K2.5 started for images too):
every test asks for the same vLLM ids, the defaults of both conventions plus the last layer
([2, 4, 5] + [8] on the 8-layer tiny model), so the worker starts once. The reference is
transformers' own `Kimi_K25ForConditionalGeneration` on text alone, a plain single-sample forward
with `output_hidden_states=True`: no hooks, no batching, nothing shared with either backend.
Tolerance: relative error (max |diff| / max |ref|, per layer) < 1e-5; measured ~1e-7-1e-6.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.exports.shards import ShardReader
from eagle3_data.stages.hidden_states.extract import extract_rows
from tests.integration.test_extract_s3 import generations, s3_env  # noqa: F401  (fixtures)

REL = 1e-5
IM_END = 163_586


@pytest.fixture(scope="module")
def reference_model(tiny_kimi_k25_dir):
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_k25_dir), dtype=torch.float32).eval()


def reference_states(model, ids):
    """The language model's hidden_states tuple (the LM head's [T, 163840] logits are never needed)."""
    with torch.no_grad():
        return model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def make_rows(lengths, seed, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = (prefix or []) + torch.randint(0, 163_584, (n,), generator=g).tolist() + [IM_END]
        rows.append(
            {
                "sample_id": f"s{seed}-{i}",
                "input_ids": ids,
                "loss_mask": [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2),
            }
        )
    return rows


def read_all(out_dir) -> dict:
    return {s.sample_id: s for p in sorted(out_dir.glob("*.safetensors")) for s in ShardReader(p)}


@pytest.mark.parametrize("convention", ["output", "input"])
def test_aux_and_last_states_equal_an_independent_forward(vllm_backend, reference_model, convention, tmp_path):
    rows = make_rows([3, 41, 17, 120, 9, 64], seed=1)
    summary = extract_rows(
        vllm_backend,
        rows,
        tmp_path,
        "v",
        HiddenStatesConfig(
            convention=convention,
            last_hidden=True,
            last_hidden_norm="post",
            storage_dtype="fp32",
            batch_tokens=256,
            shard_tokens=100,
        ),
    )
    assert summary["layer_ids"] == ([1, 3, 4] if convention == "output" else [2, 4, 5])
    assert len(summary["files"]) > 1 and summary["samples"] == len(rows)
    stored = read_all(tmp_path)
    for row in rows:
        s, hs = stored[row["sample_id"]], reference_states(reference_model, row["input_ids"])
        assert s.input_ids.tolist() == row["input_ids"] and s.loss_mask.tolist() == row["loss_mask"]
        aux = s.aux_hidden_states.reshape(len(row["input_ids"]), 3, 64)
        for j, index in enumerate([2, 4, 5]):  # both conventions' defaults name these tensors
            assert rel_err(aux[:, j], hs[index][0]) < REL, (row["sample_id"], index)
        assert rel_err(s.last_hidden_states, hs[8][0]) < REL  # final norm applied to vLLM's id L
        # the neighbouring layer is a different tensor, far outside the tolerance
        assert rel_err(aux[:, 0], hs[1][0]) > 100 * REL and rel_err(s.last_hidden_states, hs[7][0]) > 100 * REL


def test_shared_long_prefix_gives_full_length_states_for_both(vllm_backend, reference_model, tmp_path):
    """Prefix caching would hand the second sample a cached prefix without its states (vllm#44485)."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 163_584, (700,), generator=g).tolist()
    first, second = make_rows([5, 30], seed=2, prefix=prefix)
    extract_rows(
        vllm_backend,
        [first, second],
        tmp_path / "together",
        "p",
        HiddenStatesConfig(last_hidden=True, last_hidden_norm="post", storage_dtype="fp32"),
    )
    # and once more in separate batches: the prefix is in the engine's cache from the run above
    extract_rows(
        vllm_backend,
        [first],
        tmp_path / "again",
        "q",
        HiddenStatesConfig(last_hidden=True, last_hidden_norm="post", storage_dtype="fp32"),
    )
    for out in ("together", "again"):
        for sid, s in read_all(tmp_path / out).items():
            row = first if sid == first["sample_id"] else second
            assert s.aux_hidden_states.shape == (len(row["input_ids"]), 3 * 64)
            hs = reference_states(reference_model, row["input_ids"])
            aux = s.aux_hidden_states.reshape(-1, 3, 64)
            for j, index in enumerate([2, 4, 5]):
                assert rel_err(aux[:, j], hs[index][0]) < REL
            assert rel_err(s.last_hidden_states, hs[8][0]) < REL


def test_cli_extracts_every_shard_on_the_same_engine_and_the_manifest_records_it(
    vllm_backend, store, generations, tiny_kimi_k25_dir, s3_env, tmp_path
):
    import yaml

    from eagle3_data.cli import main
    from eagle3_data.config import default_config_raw
    from eagle3_data.runs.upstream import merged_shards
    from eagle3_data.storage import StageRef
    from tests.fixtures.engine import MAX_IMAGES, MAX_MODEL_LEN
    from tests.integration.test_extract_s3 import RUN

    merge_ref, out_ref = StageRef(RUN, "merge", "all"), StageRef(RUN, "hidden_states", "all")
    assert (
        main(
            [
                "merge",
                *[arg for r in generations for arg in ("--input", store.uri(r))],
                "--out-run-key",
                RUN,
                "--shard-tokens",
                "150",
                "--max-length",
                "40",
            ]
        )
        == 0
    )
    assert len(merged_shards(store, merge_ref)) > 1
    starts = vllm_backend.starts
    # the engine's context is the config's merge.max_length + 1, and its images hidden_states.max_images:
    # the ones the session's engine has
    config = tmp_path / "pipeline.yaml"
    raw = default_config_raw()
    raw["merge"]["max_length"] = MAX_MODEL_LEN - 1
    raw["hidden_states"]["max_images"] = MAX_IMAGES
    config.write_text(yaml.safe_dump(raw))
    assert (
        main(
            [
                "extract",
                "--config",
                str(config),
                "--backend",
                "vllm",
                "--model",
                str(tiny_kimi_k25_dir),
                "--input",
                store.uri(merge_ref),
                "--last-hidden",
            ]
        )
        == 0
    )
    assert vllm_backend.starts == starts  # every shard on the engine this process already runs
    manifest = store.read_manifest(out_ref)
    assert manifest["params"]["backend"] == manifest["extra"]["backend"] == "vllm"
    assert manifest["extra"]["engines"] == [vllm_backend.describe().engine]
    assert manifest["extra"]["totals"]["samples"] == 20


def test_shards_record_backend_and_engine_and_the_engine_started_once(vllm_backend, tmp_path):
    rows = make_rows([8, 12], seed=3)
    summary = extract_rows(vllm_backend, rows, tmp_path, "m", HiddenStatesConfig(last_hidden=True))
    meta = ShardReader(next(tmp_path.glob("*.safetensors"))).metadata
    assert meta["backend"] == summary["backend"] == "vllm"
    assert meta["engine"] == summary["engine"] and meta["engine"].startswith("vllm 0.32.0")
    assert (meta["dtype"], meta["compute_dtype"]) == ("bfloat16", "float32")
    assert summary["device"] == "cpu"
    assert json.loads(meta["layer_ids"]) == [1, 3, 4]
    assert vllm_backend.starts == 1  # one engine served every test of the session so far
    # the connector's per-request files were read and deleted
    assert not list((vllm_backend._root / "states").glob("*.safetensors*"))


def reference_logprobs(model, ids) -> torch.Tensor:
    """transformers' own forward and LM head: log p(ids[i] | ids[:i]) for i >= 1 (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_the_engines_answers_and_their_extraction_agree_on_every_log_probability(
    vllm_server, vllm_backend, reference_model, store, kimi_tokenizer, tmp_path, capsys
):
    """vLLM generates (sampled at temperature 1, its raw log-probabilities recorded); vLLM's
    extraction of the same ids computes its own. Both equal transformers' forward; the
    extraction's self-check passes on them and fails when a fault moves the states. The figures
    (the fp32 noise the tolerance is set from) are printed."""
    from eagle3_data.storage import StageRef
    from eagle3_data.target_head.verify import ExtractionDisagrees, LogprobCheck, engine_answers
    from tests.generation_calls import generate_vllm
    from tests.unit.test_hidden_states import Faulty

    todo = [
        {
            "sample_id": f"lp{i}",
            "dataset": "chat",
            "route": "local",
            "tools": None,
            "messages": json.dumps([{"role": "user", "content": f"Count to {i} in words."}]),
        }
        for i in range(6)
    ]
    ref = StageRef("vllm-logprobs", "generate_local", "chat")
    summary = generate_vllm(
        store,
        ref,
        todo,
        kimi_tokenizer,
        [vllm_server.url],
        {"temperature": 1.0, "max_new_tokens": 24, "thinking": True},
        journal_dir=tmp_path,
    )
    assert summary["complete"], summary
    generated = store.read_table(ref).to_pylist()
    engine_noise = 0.0
    for r in generated:
        assert json.loads(r["provenance"])["logprobs"] == {"distribution": "raw"}
        ref_lp = reference_logprobs(reference_model, r["prompt_ids"] + r["output_ids"])[len(r["prompt_ids"]) - 1 :]
        assert len(r["output_logprobs"]) == len(r["output_ids"])
        engine_noise = max(engine_noise, float((torch.tensor(r["output_logprobs"]) - ref_lp).abs().max()))
    assert engine_noise < 1e-3
    rows = [
        {
            "sample_id": r["sample_id"],
            "input_ids": r["prompt_ids"] + r["output_ids"],
            "prompt_tokens": len(r["prompt_ids"]),
            "loss_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]),
        }
        for r in generated
    ]
    answers, skipped = engine_answers(store, "vllm-logprobs", ["chat"], {r["sample_id"] for r in rows})
    assert len(answers) == 6 and not skipped
    check = LogprobCheck.for_dtype(answers, "float32")
    out = extract_rows(vllm_backend, rows, tmp_path / "ok", "ok", HiddenStatesConfig(batch_tokens=512), check=check)
    figures = out["logprob_check"]
    assert figures["compared_samples"] == 6 and figures["failed_samples"] == 0
    extraction_noise = max(
        float((s.target_logprobs[1:] - reference_logprobs(reference_model, s.input_ids.tolist())).abs().max())
        for s in read_all(tmp_path / "ok").values()
    )
    with capsys.disabled():
        print(
            f"\nlog-probabilities, fp32 CPU: engine vs transformers max |diff| {engine_noise:.2e}; extraction vs "
            f"transformers {extraction_noise:.2e}; extraction vs engine worst per-sample mean "
            f"{figures['worst_mean_abs_diff']:.2e} (tolerance {figures['tolerance']})"
        )
    for mode in ("shift", "batchmate", "early"):  # early: layer 5's output as the last state (of 8)
        check = LogprobCheck.for_dtype(answers, "float32")
        with pytest.raises(ExtractionDisagrees, match="first at position"):
            extract_rows(
                Faulty(vllm_backend, mode, layer=5 if mode == "early" else None),
                rows,
                tmp_path / mode,
                mode,
                HiddenStatesConfig(batch_tokens=512),
                check=check,
            )
