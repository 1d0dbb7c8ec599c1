"""vLLM loads `dev:tiny-qwen3-moe` (its own `Qwen3MoeForCausalLM`, from the checkpoint as built) and
its hidden states equal transformers' forward on it: the `vllm` backend on the second target family.

One engine of its own (the session's `vllm_backend` is the tiny Kimi-K2.5), stopped at the end of
the module. The reference is a plain single-sample `AutoModelForCausalLM` forward with
`output_hidden_states=True`, fp32 on both sides. Tolerance: relative error (max |diff| / max |ref|)
< 1e-5; measured ~3e-7.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.exports.shards import ShardReader
from eagle3_data.stages.hidden_states.extract import extract_rows
from tests.fixtures.qwen3 import ENDOFTEXT, IM_END

REL = 1e-5


@pytest.fixture(scope="module")
def qwen3_vllm_backend(vllm_python, tiny_qwen3_moe_dir):
    from eagle3_data.stages.hidden_states.vllm_backend import VllmBackend

    backend = VllmBackend(tiny_qwen3_moe_dir, python=vllm_python, max_model_len=512)
    yield backend
    backend.close()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_vllm_states_on_qwen3_equal_transformers_forward(qwen3_vllm_backend, tiny_qwen3_moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(5)
    rows = [
        {"sample_id": f"q{i}", "input_ids": torch.randint(0, ENDOFTEXT, (n,), generator=g).tolist() + [IM_END]}
        for i, n in enumerate([7, 40, 19])
    ]
    for row in rows:
        row["loss_mask"] = [1] * len(row["input_ids"])
    options = HiddenStatesConfig(last_hidden=True, last_hidden_norm="post", storage_dtype="fp32")
    summary = extract_rows(qwen3_vllm_backend, rows, tmp_path, "v", options)
    assert summary["layer_ids"] == [1, 3, 4] and summary["backend"] == "vllm"
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe_dir), dtype=torch.float32).eval()
    stored = {s.sample_id: s for p in sorted(tmp_path.glob("*.safetensors")) for s in ShardReader(p)}
    for row in rows:
        with torch.no_grad():
            hs = [h[0] for h in reference(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states]
        s = stored[row["sample_id"]]
        assert s.input_ids.tolist() == row["input_ids"]
        assert rel_err(s.aux_hidden_states, torch.cat([hs[2], hs[4], hs[5]], -1)) < REL, row["sample_id"]
        assert rel_err(s.last_hidden_states, hs[-1]) < REL, row["sample_id"]
