"""Kimi-K2.5's image preprocessing, for the transformers backend: an image's bytes to the
`pixel_values` and `image_grid_thw` its forward takes.

transformers' own `Kimi_K25ImageProcessor` imports torchvision at its top, which has no CPU
build here, so without this the transformers backend left every image sample out. The steps are
those of the model's processor as vLLM ships it (`KimiK25FusedVisionProcessor`,
vllm/transformers_utils/processors/kimi_k25_vision_fused.py): scale the RGB image down (never up)
until it has at most `in_patch_limit` patches and `patch_limit_on_one_side` patches a side
(`navit_resize_image`), resize with PIL's bicubic filter, pad right and bottom with zero pixels to
a multiple of patch_size x merge_kernel_size, normalise with the config's mean and std, and cut
into patch_size x patch_size patches in row-major order. tests/integration/test_kimi_pixels.py
compares the output with vLLM's processor's, value for value.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class KimiPixels:
    """The `media_proc_cfg` of a Kimi-K2.5 checkpoint's preprocessor_config.json, as a callable."""

    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> KimiPixels:
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())["media_proc_cfg"]
        merge = cfg["merge_kernel_size"]
        if cfg.get("fixed_output_tokens") is not None:
            raise ValueError(f"{model_dir}: media_proc_cfg.fixed_output_tokens is not supported")
        return cls(
            patch_size=int(cfg["patch_size"]),
            merge_kernel_size=int(merge[0] if isinstance(merge, (list, tuple)) else merge),
            in_patch_limit=int(cfg["in_patch_limit"]),
            patch_limit_on_one_side=int(cfg["patch_limit_on_one_side"]),
            image_mean=tuple(cfg["image_mean"]),
            image_std=tuple(cfg["image_std"]),
        )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The resized (width, height) before padding: navit_resize_image's arithmetic."""
        p, side = self.patch_size, self.patch_limit_on_one_side
        s1 = math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
        scale = min(1.0, s1, side * p / width, side * p / height)
        return min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p)

    def __call__(self, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 3, p, p] float32, image_grid_thw [1, 3] int64) of one image."""
        from PIL import Image

        image = Image.open(io.BytesIO(data)).convert("RGB")
        new_w, new_h = self.size(*image.size)
        frame = np.asarray(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)
        p, factor = self.patch_size, self.patch_size * self.merge_kernel_size
        padded_h, padded_w = -(-new_h // factor) * factor, -(-new_w // factor) * factor
        canvas = np.zeros((padded_h, padded_w, 3), dtype=np.uint8)
        canvas[:new_h, :new_w] = frame
        # vLLM normalises through a float32 table of (v / 255 - mean) * (1 / std): the same order here
        lut = (
            np.arange(256, dtype=np.float32)[:, None] / np.float32(255.0) - np.asarray(self.image_mean, np.float32)
        ) * (np.float32(1.0) / np.asarray(self.image_std, np.float32))
        normed = lut[canvas, np.arange(3)]  # [H, W, 3]
        gh, gw = padded_h // p, padded_w // p
        patches = normed.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return torch.from_numpy(np.ascontiguousarray(patches)), torch.tensor([[1, gh, gw]], dtype=torch.int64)
