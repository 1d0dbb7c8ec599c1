"""A tiny random Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers' own class): the second target family.

What the real Qwen3-30B-A3B / Qwen3-235B-A22B checkpoints have, kept here so every path that
loads them (transformers, vLLM's `Qwen3MoeForCausalLM`, the trainers' readers of the exports)
loads this one the same way:

- Qwen3's vocabulary (`dev:qwen3-tokenizer`, 151,669 ids) in an embedding padded to the
  config's `vocab_size` of 151,936, as the real config pads it; the padded rows are no token;
- an explicit `head_dim` that is not `hidden_size / num_attention_heads` (the real ones: 128
  with 32 or 64 heads over 2048 or 4096), grouped-query attention, q/k norms, every layer sparse
  (`decoder_sparse_step` 1, no `mlp_only_layers`), `norm_topk_prob` true, untied embeddings,
  `<|endoftext|>` bos and `<|im_end|>` eos, rope theta 1e6 and 40,960 positions;
- the tiny shapes are ones vLLM's CPU kernels take (a head size of 32, its smallest).

The lm_head is peaked as the tiny DeepSeek-V3's is (`tiny_model.shape_lm_head`: the same
`LM_HEAD_SCALE`, the added tokens' and byte pieces' rows zeroed), and the padded rows are zeroed
too, so sampled text is ordinary text and never an id the tokenizer lacks. The weights are a
pure function of the seed and the shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_data.builds.tiny_model import complete_model_dir, shape_lm_head

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen3MoeConfig, Qwen3MoeForCausalLM

QWEN3_VOCAB_SIZE = 151_936  # Qwen3's config.json: the embedding rows, past the tokenizer's 151,669 ids
MARKER = "eagle3_tiny_qwen3_moe.json"


def tiny_qwen3_moe_config(tokenizer: PreTrainedTokenizerBase, *, layers: int = 8, hidden: int = 64) -> Qwen3MoeConfig:
    """A Qwen3MoeConfig shaped like the real ones, at a width that runs on CPU in a second."""
    from transformers import Qwen3MoeConfig

    bos_id, eos_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert isinstance(bos_id, int) and isinstance(eos_id, int)  # one token each, one id each
    return Qwen3MoeConfig(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,  # the dense MLP size: unused while every layer is sparse, as in Qwen3
        moe_intermediate_size=max(8, hidden // 2),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # type: ignore[call-arg]  # a real Qwen3MoeConfig argument its signature does not declare
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40_960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def tiny_qwen3_moe_model(
    tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Qwen3MoeForCausalLM:
    """The bf16 `Qwen3MoeForCausalLM` in memory, lm_head shaped: a pure function of its arguments."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    if layers < 4:
        raise ValueError(f"layers={layers}: EAGLE-3 aux layer ids [1, L//2-1, L-4] need at least 4 layers")
    config = tiny_qwen3_moe_config(tokenizer, layers=layers, hidden=hidden)
    config.dtype = "bfloat16"
    with torch.random.fork_rng(devices=[]):  # seeding must not leak into the caller's RNG state
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
        shape_lm_head(model, tokenizer)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer) :] = 0.0  # the padding rows: no token of the tokenizer
    # in place (`Module.to` returns the module itself); transformers types `to` as an unbound
    # wrapper (self first) returning Any: the stubs, not the call, are wrong
    model.to(torch.bfloat16)  # type: ignore[arg-type]
    return model


def build_tiny_qwen3_moe(
    tokenizer_dir: str | Path, out_dir: str | Path, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Path:
    """Write an `AutoModelForCausalLM`- and vLLM-loadable directory: bf16 safetensors + tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = tiny_qwen3_moe_model(tokenizer, seed=seed, layers=layers, hidden=hidden)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    args = {"seed": seed, "layers": layers, "hidden": hidden}
    return complete_model_dir(out, tokenizer_dir, MARKER, args, len(tokenizer))


def cached_tiny_qwen3_moe(
    tokenizer_dir: str | Path, cache_root: str | Path, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Path:
    """The model built once under `cache_root/tiny-qwen3-moe-{key}`: keyed by this module, the
    lm_head shaping it borrows (tiny_model.py), the arguments and the tokenizer build's name."""
    from eagle3_data.builds import tiny_model
    from eagle3_data.builds.build_cache import cached_build

    args = {"seed": seed, "layers": layers, "hidden": hidden}
    key = (
        Path(__file__).read_bytes()
        + Path(tiny_model.__file__).read_bytes()
        + repr(sorted(args.items())).encode()
        + Path(tokenizer_dir).name.encode()
    )
    return cached_build(
        cache_root, "tiny-qwen3-moe", key, MARKER, lambda out: build_tiny_qwen3_moe(tokenizer_dir, out, **args)
    )
