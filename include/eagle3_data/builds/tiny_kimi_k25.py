"""A tiny random Kimi-K2.5 (`KimiK25ForConditionalGeneration`): the real model's class and layout.

The tiny DeepSeek-V3 (`tiny_model`) is Kimi-K2.5's text stack alone; the real checkpoint is a
vision-language model whose keys read `language_model.model.*`, `vision_tower.encoder.blocks.*`
and `mm_projector.proj.*`, whose config nests `text_config` and `vision_config`, and which takes
images (`<|media_pad|>` positions filled by MoonViT's features). Built here with transformers'
own classes, so every engine path that loads the real model loads this one the same way:

- the text stack is the tiny DeepSeek-V3 itself, weight for weight (`tiny_model.tiny_text_model`
  of the same seed: MLA + MoE with the shapes vLLM's CPU kernels take, Kimi's yarn rope, the
  engine routing keys written into `text_config`, the peaked, never-special `lm_head`), so its
  text is the DeepSeek-V3's: as peaked (the policy trials' power was measured on it), and either
  build stands in for the other on text;
- the vision tower is a two-layer MoonViT at width 64 (4 heads of 16: the axial rope needs a
  head size divisible by 4), its projector into the text width;
- the special ids are read from the tokenizer by name (`<|media_pad|>` is the image token);
- `save_pretrained` writes transformers' original-format keys (its `kimi_k25` conversion
  mapping run backwards): the layout of Moonshot's safetensors, which vLLM's loader maps itself;
- `use_unified_vision_chunk: true`, as in Moonshot's config.json (images are `vision_chunk` items);
- `preprocessor_config.json` carries Kimi-K2.5's `media_proc_cfg` (what vLLM's Kimi image
  processor reads: 14-pixel patches merged 2x2, mean/std 0.5), so engines count an image's
  media tokens the way they do for the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_data.builds.tiny_model import ENGINE_CONFIG_KEYS, complete_model_dir, tiny_config, tiny_text_model

VISION_ARGS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
}
# Kimi-K2.5's preprocessor_config.json `media_proc_cfg` (the fields vLLM's processors read).
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "media_proc_cfg",
}
MARKER = "eagle3_tiny_kimi_k25.json"


def tiny_kimi_k25_config(tokenizer, *, layers: int = 8, hidden: int = 64):
    """A Kimi_K25Config: the tiny text stack, a two-layer MoonViT, Kimi's special ids by name."""
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    ids = {
        name: tokenizer.convert_tokens_to_ids(name)
        for name in ("[BOS]", "[EOS]", "[PAD]", "<|media_pad|>", "<|media_begin|>", "<|media_end|>")
    }
    text = tiny_config(
        len(tokenizer),
        layers=layers,
        hidden=hidden,
        special={"bos": ids["[BOS]"], "eos": ids["[EOS]"], "pad": ids["[PAD]"]},
    )
    vision = Kimi_K25VisionConfig(**VISION_ARGS)
    return Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=vision.hidden_size,
        image_token_id=ids["<|media_pad|>"],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,  # Kimi-K2.5 unties them; the shaped lm_head must stay its own
        bos_token_id=ids["[BOS]"],
        eos_token_id=ids["[EOS]"],
        pad_token_id=ids["[PAD]"],
    )


# transformers 5.24 runs its kimi_k25 conversion backwards on save, and three renames do not
# invert: its generic `blocks -> layers` also hits the text layers, and the projector's pre-norm
# and the patch embedding get no rename back. Moonshot's names, which vLLM's loader
# (kimi_k25.py `hf_to_vllm_mapper`, kimi_k25_vit.py module names) and transformers' own loader
# both read, are these.
KEY_FIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)


def _moonshot_key_names(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {}
    for key, tensor in tensors.items():
        for wrong, right in KEY_FIXES:
            if key.startswith(wrong):
                key = right + key[len(wrong) :]
        renamed[key] = tensor
    save_file(renamed, str(path), metadata={"format": "pt"})


def tiny_kimi_k25_model(tokenizer, *, seed: int = 0, layers: int = 8, hidden: int = 64):
    """The bf16 model in memory: a pure function of the tokenizer, the seed and the shapes. The
    vision tower and projector are this seed's init in this class; the text stack (decoder and
    lm_head) is the tiny DeepSeek-V3 of the same seed, copied in before the cast to bf16."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    text = tiny_text_model(tokenizer, seed=seed, layers=layers, hidden=hidden)  # raises for layers < 4
    config = tiny_kimi_k25_config(tokenizer, layers=layers, hidden=hidden)
    config.dtype = "bfloat16"
    with torch.random.fork_rng(devices=[]):  # seeding must not leak into the caller's RNG state
        torch.manual_seed(seed)
        model = Kimi_K25ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())  # strict: every tensor, same names
        model.lm_head.weight.copy_(text.lm_head.weight)
    return model.to(torch.bfloat16)


def build_tiny_kimi_k25(
    tokenizer_dir: str | Path, out_dir: str | Path, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Path:
    """Write a `Kimi_K25ForConditionalGeneration` directory in the real checkpoint layout."""
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = tiny_kimi_k25_model(tokenizer, seed=seed, layers=layers, hidden=hidden)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)  # save_original_format: Moonshot's key names...
    _moonshot_key_names(out / "model.safetensors")  # ...but for the three it gets wrong
    config_path = out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["text_config"].update(ENGINE_CONFIG_KEYS)
    # Moonshot's class name, the one vLLM registers (transformers writes its own `Kimi_K25...`,
    # which vLLM would run through its generic transformers backend instead).
    config_json["architectures"] = ["KimiK25ForConditionalGeneration"]
    # Moonshot's config.json flag (transformers' class drops it): images and video chunks are one
    # modality, `vision_chunk`, the only one vLLM's Kimi-K2.5 registers; without it vLLM's request
    # parsers count an `image_url` part as an `image`, which the model takes none of ("At most 0
    # image(s) may be provided in one prompt"): renderers/chat_utils.py `_validate_add`.
    config_json["use_unified_vision_chunk"] = True
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    args = {"seed": seed, "layers": layers, "hidden": hidden}
    return complete_model_dir(out, tokenizer_dir, MARKER, args, len(tokenizer))


def cached_tiny_kimi_k25(
    tokenizer_dir: str | Path, cache_root: str | Path, *, seed: int = 0, layers: int = 8, hidden: int = 64
) -> Path:
    """The model built once under `cache_root/tiny-kimi-k25-{key}` (keyed like `cached_tiny_model`,
    plus the text stack's builder, whose source shapes this model too)."""
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
        cache_root, "tiny-kimi-k25", key, MARKER, lambda out: build_tiny_kimi_k25(tokenizer_dir, out, **args)
    )
