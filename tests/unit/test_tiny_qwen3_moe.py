"""`dev:tiny-qwen3-moe`, the second target family: the build is transformers' own Qwen3-MoE in the
real checkpoint's shape, EAGLE-3's aux layers follow its layer count as both trainers' Qwen3
configs do, and the extraction equals transformers' own forward on it.

The oracle is a plain `AutoModelForCausalLM` forward of one sample with `output_hidden_states=True`
and its own LM head (no hooks, no batching, no padding), in fp32 as the backend computes on CPU;
the states are stored in fp32 here, so only summation-order noise (1e-5) separates them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors import safe_open

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.exports.shards import ShardReader
from eagle3_data.stages.hidden_states.backends import TransformersBackend
from eagle3_data.stages.hidden_states.extract import extract_rows
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices
from tests.fixtures.qwen3 import ENDOFTEXT, IM_END, NUM_TOKENS

REL = 1e-5


@pytest.fixture(scope="module")
def config(tiny_qwen3_moe_dir) -> dict:
    return json.loads((tiny_qwen3_moe_dir / "config.json").read_text())


def test_the_build_is_transformers_qwen3_moe_shaped_like_the_real_checkpoint(tiny_qwen3_moe_dir, config):
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert config["vocab_size"] == 151_936 > NUM_TOKENS  # Qwen3's padded embedding, past the tokenizer's ids
    assert (config["bos_token_id"], config["eos_token_id"]) == (ENDOFTEXT, IM_END)
    assert config["tie_word_embeddings"] is False and config["norm_topk_prob"] is True
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]  # as Qwen3's: head_dim its own
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []  # every layer sparse
    assert config["rope_parameters"]["rope_theta"] == 1_000_000.0
    with safe_open(str(tiny_qwen3_moe_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    # Qwen's own checkpoint layout (one tensor per expert), the one vLLM's loader reads
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys and "model.layers.0.mlp.gate.weight" in keys
    assert "model.layers.0.self_attn.q_norm.weight" in keys
    assert head.dtype == torch.bfloat16 and head.shape == embed.shape == (151_936, config["hidden_size"])
    assert not torch.equal(head, embed)  # untied
    assert not head[NUM_TOKENS:].any() and head[:NUM_TOKENS].any()  # the padded rows: never sampled
    assert not head[ENDOFTEXT:NUM_TOKENS].any()  # nor the added tokens
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tiny_qwen3_moe_dir / name).exists()


def test_dev_source_names_the_same_build(tiny_qwen3_moe_dir):
    from eagle3_data.builds.sources import DEV_SOURCES, resolve_dev_source

    assert "tiny-qwen3-moe" in DEV_SOURCES
    assert resolve_dev_source("tiny-qwen3-moe", tiny_qwen3_moe_dir.parent) == tiny_qwen3_moe_dir


def test_default_aux_layers_are_the_trainers_qwen3_layers(config):
    """SpecForge's configs/qwen3-235B-A22B-eagle3.json writes `eagle_aux_hidden_state_layer_ids`
    [1, 46, 90] for the 94-layer model (outputs); speculators' `resolve_target_layer_ids` defaults to
    [2, L//2, L-3] (inputs). The same three tensors, from `num_hidden_layers` alone."""
    assert default_layer_ids(94, "output") == [1, 46, 90]  # Qwen3-235B-A22B
    assert default_layer_ids(94, "input") == [2, 47, 91]
    assert default_layer_ids(48, "output") == [1, 23, 44]  # Qwen3-30B-A3B
    assert default_layer_ids(48, "input") == [2, 24, 45]
    layers = config["num_hidden_layers"]
    assert default_layer_ids(layers, "output") == [1, 3, 4] and default_layer_ids(layers, "input") == [2, 4, 5]
    for n in (layers, 48, 94):
        assert hidden_state_indices(default_layer_ids(n, "output"), "output", n) == hidden_state_indices(
            default_layer_ids(n, "input"), "input", n
        )


@pytest.fixture(scope="module")
def reference_model(tiny_qwen3_moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe_dir), dtype=torch.float32).eval()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("convention", ["output", "input"])
def test_extracted_states_and_logprobs_equal_transformers_forward(
    tiny_qwen3_moe_dir, reference_model, convention, tmp_path
):
    g = torch.Generator().manual_seed(5)
    rows: list[dict[str, Any]] = []
    for i, n in enumerate([3, 37, 12, 60, 21]):
        ids = torch.randint(0, ENDOFTEXT, (n,), generator=g).tolist() + [IM_END]
        rows.append({"sample_id": f"q{i}", "input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n + 1 - n // 2)})
    backend = TransformersBackend(tiny_qwen3_moe_dir)
    info = backend.describe()
    assert (info.num_layers, info.vocab_size, info.dtype) == (8, 151_936, "float32")
    options = HiddenStatesConfig(
        convention=convention,
        last_hidden=True,
        last_hidden_norm="post",
        storage_dtype="fp32",
        batch_tokens=96,  # several samples per batch: right padding under the MoE routing
        shard_tokens=70,
    )
    summary = extract_rows(backend, rows, tmp_path, "q", options)
    assert summary["layer_ids"] == ([1, 3, 4] if convention == "output" else [2, 4, 5]) and len(summary["files"]) > 1
    stored = {s.sample_id: s for p in sorted(tmp_path.glob("*.safetensors")) for s in ShardReader(p)}
    for row in rows:
        ids = row["input_ids"]
        with torch.no_grad():
            out = reference_model(torch.tensor([ids]), output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]
        s = stored[row["sample_id"]]
        assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == row["loss_mask"]
        ref = torch.cat([hs[2], hs[4], hs[5]], -1)  # outputs of layers 1, 3, 4 = inputs of layers 2, 4, 5
        assert rel_err(s.aux_hidden_states, ref) < REL, row["sample_id"]
        off_by_one = torch.cat([hs[1], hs[3], hs[4]], -1)
        assert rel_err(s.aux_hidden_states, off_by_one) > 100 * REL
        assert s.last_hidden_states is not None and s.target_logprobs is not None
        assert rel_err(s.last_hidden_states, hs[-1]) < REL  # post: the model's own final norm's output
        logprobs = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert torch.isnan(s.target_logprobs[0])
        assert torch.allclose(s.target_logprobs[1:], logprobs, atol=1e-4, rtol=0), row["sample_id"]
