"""`dev:NAME` sources: the builds a config can name instead of a path, made offline on first use.

The packaged default config points at `dev:kimi-tokenizer` (the real Kimi-K2.5 tokenizer,
rebuilt from splintr-rs) and `dev:tiny-kimi-k25` (a tiny random `KimiK25ForConditionalGeneration`
in Moonshot's checkpoint layout, so every default run loads the real model's class), and runs
from a wheel install with no checkout and no download. `dev:tiny-deepseek-v3` is that model's
text stack alone, weight for weight (a `DeepseekV3ForCausalLM` with Kimi's vocabulary): kept for
what needs a text-only target or a second model (docs/hidden_states.md). `dev:tiny-qwen3-moe` is
the second target family: a tiny random `Qwen3MoeForCausalLM` with Qwen3's vocabulary. Builds are keyed by
their builder's source (see `build_cache`) and live under `$EAGLE3_DATA_CACHE/dev` (default
`~/.cache/eagle3-data/dev`).
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_data.cache import cache_root
from eagle3_data.errors import UserError

TINY_MODEL_ARGS = {"seed": 0, "layers": 8, "hidden": 64}  # the dev stack's and the tests' tiny model
DEV_SOURCES = ("kimi-tokenizer", "qwen3-tokenizer", "tiny-deepseek-v3", "tiny-kimi-k25", "tiny-qwen3-moe")


def dev_cache_root() -> Path:
    return cache_root() / "dev"


def resolve_dev_source(name: str, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """The directory of dev build `name`, built now if absent."""
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer

    root = Path(cache_root) if cache_root else dev_cache_root()
    if name == "kimi-tokenizer":
        return cached_kimi_tokenizer(root)
    if name == "qwen3-tokenizer":
        from eagle3_data.builds.qwen3_tokenizer import cached_qwen3_tokenizer

        return cached_qwen3_tokenizer(root)
    if name == "tiny-deepseek-v3":
        from eagle3_data.builds.tiny_model import cached_tiny_model

        return cached_tiny_model(cached_kimi_tokenizer(root), root, **TINY_MODEL_ARGS)
    if name == "tiny-kimi-k25":
        from eagle3_data.builds.tiny_kimi_k25 import cached_tiny_kimi_k25

        return cached_tiny_kimi_k25(cached_kimi_tokenizer(root), root, **TINY_MODEL_ARGS)
    if name == "tiny-qwen3-moe":
        from eagle3_data.builds.qwen3_tokenizer import cached_qwen3_tokenizer
        from eagle3_data.builds.tiny_qwen3_moe import cached_tiny_qwen3_moe

        return cached_tiny_qwen3_moe(cached_qwen3_tokenizer(root), root, **TINY_MODEL_ARGS)
    raise UserError(f"source dev:{name}: unknown dev build (known: {', '.join('dev:' + n for n in DEV_SOURCES)})")
