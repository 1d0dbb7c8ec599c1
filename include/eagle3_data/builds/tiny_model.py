"""A tiny random DeepSeek-V3 with Kimi-K2.5's vocabulary: the target model for offline runs.

Its next-token distributions are peaked (`LM_HEAD_SCALE`), so its text is its own.

Kimi-K2.5's text backbone is DeepSeek-V3 (MLA + MoE), so the tiny model exercises the same
`transformers` code path (hidden-state indexing, MoE routing, MLA attention) as the real one,
while the vocabulary comes from the real tokenizer so ids never index out of range. Weights are
a pure function of the seed and the shape arguments: the same call gives the same
safetensors bytes, so tests can cache the directory by the hash of this file.

The shapes are also the ones a real engine accepts (vLLM's CPU MLA kernels, ENVIRONMENT.md):
`kv_lora_rank=512` and `qk_rope_head_dim=64` (the only sizes those kernels take), Kimi-K2.5's
yarn `rope_parameters` (with `rope_type: default` vLLM's CPU rotary kernel mishandles MLA's
strided q_pe/k_pe views, 1.2% error), and `topk_method: noaux_tc` + `scoring_func: sigmoid`
written into config.json: transformers 5.x always routes that way but writes neither key, and
without them vLLM fails on `e_score_correction_bias` or silently routes with softmax.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Files of a tokenizer directory that a model directory carries so it loads on its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tiktoken.model",
)


def complete_model_dir(out: Path, tokenizer_dir: Path, marker: str, args: dict[str, int], vocab_size: int) -> Path:
    """Finish a dev model directory: the tokenizer's files beside the weights (so it loads on its
    own), then `marker` with the build's arguments, written last: the file `cached_build` waits for."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)
    (out / marker).write_text(json.dumps({**args, "vocab_size": vocab_size}, indent=2) + "\n")
    return out


# Kimi-K2.5's text config (rope_scaling there; transformers 5.x calls it rope_parameters).
KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50_000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# Routing keys DeepSeek-V3/Kimi checkpoints carry and engines read (transformers does not write them).
ENGINE_CONFIG_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# Peaked next-token distributions. A random init leaves the logits within ~0.2 of each other:
# near-uniform over Kimi's 163840 ids, so any text is about as likely as any other under any seed.
# Scaled by this, they spread by ~5 (a few tokens hold most of the mass at each step), so a
# model's sampled text is characteristic of it: the policy check tells two seeds' text apart on
# CPU. The rows of the tokenizer's added tokens, and of the tokens that are no whole UTF-8 text on
# their own (byte pieces of a character), are zeroed (logit 0, far below the top ones): sampled
# text is ordinary text, never a stop, a structural token or a cut character by chance.
LM_HEAD_SCALE = 30.0


def _never_sampled(tokenizer) -> list[int]:
    """Added (special) tokens and byte pieces: the ids whose lm_head rows are zeroed."""
    added = set(tokenizer.get_added_vocab().values())
    pieces = {i for i in range(len(tokenizer)) if i not in added and "\ufffd" in tokenizer.decode([i])}
    return sorted(added | pieces)


def shape_lm_head(model, tokenizer) -> None:
    """Give the router's correction bias values and peak the lm_head (`LM_HEAD_SCALE`), in place.

    Random init leaves the correction bias at zero; non-trivial numbers exercise the grouped
    top-k routing path. Uses the caller's (seeded) RNG.
    """
    import torch

    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn_like(bias) * 0.01)
        head = model.get_output_embeddings().weight
        head.mul_(LM_HEAD_SCALE)
        head[_never_sampled(tokenizer)] = 0.0


def tiny_config(vocab_size: int, *, layers: int = 8, hidden: int = 64, special: dict[str, int] | None = None):
    """A DeepseekV3Config that builds and runs on CPU in about a second, in transformers and in vLLM."""
    from transformers import DeepseekV3Config

    special = special or {}
    heads = max(1, hidden // 16)
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=max(8, hidden // 2),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=262_144,  # Kimi-K2.5: original 4096 x yarn factor 64
        rope_parameters=dict(KIMI_ROPE),
        bos_token_id=special.get("bos"),
        eos_token_id=special.get("eos"),
        pad_token_id=special.get("pad"),
        tie_word_embeddings=False,
    )


def tiny_text_model(tokenizer, *, seed: int = 0, layers: int = 8, hidden: int = 64):
    """The fp32 `DeepseekV3ForCausalLM` in memory, lm_head shaped: a pure function of the tokenizer,
    the seed and the shapes. The tiny Kimi-K2.5 takes its text stack from here too, so both
    builds are one text model (tested weight for weight)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    if layers < 4:
        raise ValueError(f"layers={layers}: EAGLE-3 aux layer ids [1, L//2-1, L-4] need at least 4 layers")
    special = {
        "bos": tokenizer.convert_tokens_to_ids("[BOS]"),
        "eos": tokenizer.convert_tokens_to_ids("[EOS]"),
        "pad": tokenizer.convert_tokens_to_ids("[PAD]"),
    }
    config = tiny_config(len(tokenizer), layers=layers, hidden=hidden, special=special)
    config.dtype = "bfloat16"

    # fork_rng: seeding must not leak into (or depend on) the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
        shape_lm_head(model, tokenizer)
    return model


def build_tiny_model(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 8,
    hidden: int = 64,
) -> Path:
    """Write an `AutoModelForCausalLM`-loadable directory (bf16 weights + tokenizer files)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = tiny_text_model(tokenizer, seed=seed, layers=layers, hidden=hidden).to(torch.bfloat16)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    config_path = out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json.update(ENGINE_CONFIG_KEYS)
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    args = {"seed": seed, "layers": layers, "hidden": hidden}
    return complete_model_dir(out, tokenizer_dir, "eagle3_tiny_model.json", args, len(tokenizer))


def cached_tiny_model(
    tokenizer_dir: str | Path, cache_root: str | Path, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Path:
    """The model built once under `cache_root/tiny-deepseek-v3-{key}`.

    The key hashes this module, the arguments and the tokenizer directory's name (itself keyed
    by the tokenizer builder), so a stale model can never be tested against.
    """
    from eagle3_data.builds.build_cache import cached_build

    args = {"seed": seed, "layers": layers, "hidden": hidden}
    key = Path(__file__).read_bytes() + repr(sorted(args.items())).encode() + Path(tokenizer_dir).name.encode()
    return cached_build(
        cache_root,
        "tiny-deepseek-v3",
        key,
        "model.safetensors",
        lambda out: build_tiny_model(tokenizer_dir, out, **args),
    )
