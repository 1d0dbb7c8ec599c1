"""The target's final RMSNorm, which sits between the last layer's output and the LM head.

EAGLE-3 trainers disagree on which side of it the "last hidden state" is: speculators stores
the last layer's output before the norm and applies its own frozen `verifier_norm`
(speculators train/data.py takes `hidden_states[:, -1]` as `verifier_last_hidden_states`);
SpecForge stores the normed state it feeds to the LM head. The extractor keeps the state before
the norm (`last_hidden_norm: pre`, the default) and records the norm's weight and eps with every
shard, so `export-specforge` gives SpecForge its normed state and no export needs the GPU stage
again; `post` stores the normed state (SpecForge's convention) instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_data.errors import UserError

NORMS = ("pre", "post")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V3's RMSNorm exactly as transformers computes it (fp32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def checkpoint_weight(model_dir: str | Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """One tensor read from a safetensors checkpoint alone (its index, else every file's keys): the
    shortest key that is one of `names` or ends in `.{name}` (Kimi-K2.5 nests the text model under
    `language_model.`); None when none is there."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                weight_map.update(dict.fromkeys(st.keys(), f.name))
    keys = sorted((k for k in weight_map if any(k == n or k.endswith("." + n) for n in names)), key=len)
    if not keys:
        return None
    with safe_open(str(model_dir / weight_map[keys[0]]), framework="pt") as st:
        return st.get_tensor(keys[0])


def final_norm_weight(model_dir: str | Path) -> torch.Tensor:
    """The final RMSNorm weight, read from the checkpoint alone (`model.norm.weight`, or
    `language_model.model.norm.weight` for Kimi-K2.5)."""
    weight = checkpoint_weight(model_dir, ("model.norm.weight",))
    if weight is None:
        raise UserError(f"model {model_dir}: no final norm weight (*model.norm.weight) in the checkpoint")
    return weight


def final_norm_eps(model_dir: str | Path) -> float:
    """`rms_norm_eps` of the model's config (Kimi-K2.5: under `text_config`)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return float(cfg.get("rms_norm_eps", (cfg.get("text_config") or {}).get("rms_norm_eps", 1e-6)))


def check_norm(choice: str) -> None:
    if choice not in NORMS:
        raise UserError(
            f"last_hidden_norm {choice!r}: expected pre (before the final norm: speculators) or post "
            "(after it: SpecForge)"
        )
