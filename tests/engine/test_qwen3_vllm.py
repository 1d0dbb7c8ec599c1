"""vLLM loads `dev:tiny-qwen3-moe` (its own `Qwen3MoeForCausalLM`, from the checkpoint as built):
its greedy answers are transformers' and its hidden states equal transformers' forward, so the
`vllm` backend and the generation engine both run the second target family.

Engines of their own (the session's `vllm_backend` is the tiny Kimi-K2.5). The reference is
transformers' own `AutoModelForCausalLM`: `generate` for the answers, a plain single-sample forward
with `output_hidden_states=True` for the states, fp32 on both sides (in bf16 the two engines' greedy
choices part on the random model's close logits). Tolerance for the states: relative error
(max |diff| / max |ref|) < 1e-5; measured ~3e-7.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.exports.shards import ShardReader
from eagle3_data.stages.hidden_states.extract import extract_rows
from tests.fixtures.qwen3 import ENDOFTEXT, IM_END

REL = 1e-5
GENERATE = Path(__file__).with_name("qwen3_vllm_generate.py")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_qwen3_moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_moe_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_vllm_backend(vllm_python, tiny_qwen3_moe_dir):
    from eagle3_data.stages.hidden_states.vllm_backend import VllmBackend

    backend = VllmBackend(tiny_qwen3_moe_dir, python=vllm_python, max_model_len=512)
    yield backend
    backend.close()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_vllm_answers_qwen3_prompts_as_transformers_does(vllm_python, tiny_qwen3_moe_dir, reference, qwen3_tokenizer):
    chats = ("Hello", "Write a haiku about the sea.")
    texts = [
        qwen3_tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in chats
    ]
    prompts = [qwen3_tokenizer.encode(text, add_special_tokens=False) for text in texts]
    done = subprocess.run(
        [vllm_python, str(GENERATE), str(tiny_qwen3_moe_dir), str(NEW_TOKENS)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for prompt, answer in zip(prompts, answers):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert answer == out[0, len(prompt) :].tolist()
        assert max(answer) < len(qwen3_tokenizer)  # never a padded row of the embedding


def test_vllm_states_on_qwen3_equal_transformers_forward(qwen3_vllm_backend, reference, tmp_path):
    g = torch.Generator().manual_seed(5)
    rows: list[dict[str, Any]] = [
        {"sample_id": f"q{i}", "input_ids": torch.randint(0, ENDOFTEXT, (n,), generator=g).tolist() + [IM_END]}
        for i, n in enumerate([7, 40, 19])
    ]
    for row in rows:
        row["loss_mask"] = [1] * len(row["input_ids"])
    options = HiddenStatesConfig(last_hidden=True, last_hidden_norm="post", storage_dtype="fp32")
    summary = extract_rows(qwen3_vllm_backend, rows, tmp_path, "v", options)
    assert summary["layer_ids"] == [1, 3, 4] and summary["backend"] == "vllm"
    stored = {s.sample_id: s for p in sorted(tmp_path.glob("*.safetensors")) for s in ShardReader(p)}
    for row in rows:
        with torch.no_grad():
            hs = [h[0] for h in reference(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states]
        s = stored[row["sample_id"]]
        assert s.input_ids.tolist() == row["input_ids"]
        assert rel_err(s.aux_hidden_states, torch.cat([hs[2], hs[4], hs[5]], -1)) < REL, row["sample_id"]
        assert s.last_hidden_states is not None
        assert rel_err(s.last_hidden_states, hs[-1]) < REL, row["sample_id"]
