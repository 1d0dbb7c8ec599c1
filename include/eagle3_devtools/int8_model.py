"""A checkpoint's int8-rounded copy: what a provider serving a lower-bit quantisation runs.

Every linear weight (2-D, outside the embeddings and the LM head, which int8 schemes keep in
16 bits) is rounded per output channel to int8 (symmetric: scale = max |w| of the row / 127) and
stored back in the checkpoint's dtype, so any engine loads it as the original model with
slightly other weights. Built once under the cache root, keyed by this module and the source
directory's name (itself keyed by its builder), like the tiny model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

KEPT = ("embed_tokens", "lm_head")  # 16-bit in int8 schemes (W8A8, W8A16): not rounded


def round_int8(w):
    """`w` rounded per output channel (row) to symmetric int8, back in its own dtype."""
    import torch

    x = w.to(torch.float32)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return (torch.round(x / scale).clamp(-127, 127) * scale).to(w.dtype)


def build_int8_model(src: str | Path, out: str | Path) -> dict:
    """Write the rounded copy of `src` into `out`; returns what was rounded (tensors, and the
    relative RMS change of their weights)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rounded, num, den = 0, 0.0, 0.0
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
            continue
        tensors = load_file(str(f))
        for name, w in tensors.items():
            if w.ndim == 2 and name.endswith(".weight") and not any(k in name for k in KEPT):
                q = round_int8(w)
                num += float((q.float() - w.float()).pow(2).sum())
                den += float(w.float().pow(2).sum())
                tensors[name], rounded = q, rounded + 1
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    info = {"rounded_tensors": rounded, "relative_rms_change": (num / den) ** 0.5 if den else 0.0}
    (out / "eagle3_int8.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def cached_int8_model(src: str | Path, cache_root: str | Path) -> Path:
    """The int8-rounded copy of `src`, built once under `cache_root/{src name}-int8-{key}`."""
    from eagle3_data.builds.build_cache import cached_build

    key = Path(__file__).read_bytes() + Path(src).name.encode()
    return cached_build(
        cache_root, f"{Path(src).name}-int8", key, "eagle3_int8.json", lambda out: build_int8_model(src, out)
    )
