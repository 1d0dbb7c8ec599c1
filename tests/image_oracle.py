"""What transformers' own Kimi-K2.5 processor makes of an image prompt, as the tests' reference.

`image_tokens(width, height)`: Kimi_K25ImageProcessor.get_number_of_image_patches (what vLLM asks
it for) with the class's defaults, divided by merge_size**2 as Kimi_K25Processor does. The module
imports torchvision at its top, which has no CPU wheel here, so the two functions are compiled
from transformers' own source text (neither calls torchvision).
`processor_ids(tokenizer, messages, sizes)`: the processor's way to the ids: the template's text
with each `<|media_pad|>` repeated (Kimi_K25Processor.replace_image_token), then tokenized.
`vllm_pixels(...)`: the pixels of a forward with images, from vLLM's own Kimi-K2.5 image processor
run alone in the vLLM venv (transformers' imports torchvision): what transformers' forward is given
when a test compares an engine's states of an image sample with it.
"""

from __future__ import annotations

import ast
import math
import subprocess
from functools import cache
from pathlib import Path


@cache
def _count():
    import transformers

    path = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    navit = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kimi_K25ImageProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_number_of_image_patches")
    defaults = {
        t.targets[0].id: ast.literal_eval(t.value)
        for t in cls.body
        if isinstance(t, ast.Assign)
        and isinstance(t.targets[0], ast.Name)
        and t.targets[0].id in ("size", "patch_size", "merge_size", "max_patches")
    }
    scope: dict = {"math": math}
    exec(compile(ast.Module([navit, method], []), str(path), "exec"), scope)
    return scope["get_number_of_image_patches"], type("Defaults", (), defaults)(), defaults["merge_size"]


def image_tokens(width: int, height: int) -> int:
    patches, proc, merge = _count()
    return patches(proc, height, width) // merge**2


def processor_ids(
    tokenizer, messages: list[dict], sizes: list[tuple[int, int]], *, tools=None, thinking: bool = True
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, thinking=thinking
    )
    pieces = text.split("<|media_pad|>")
    assert len(pieces) == len(sizes) + 1, f"{len(pieces) - 1} placeholders for {len(sizes)} images"
    out = pieces[0]
    for (w, h), piece in zip(sizes, pieces[1:]):
        out += "<|media_pad|>" * image_tokens(w, h) + piece
    return tokenizer.encode(out, add_special_tokens=False)


_PIXELS = r"""
import io, json, sys
from PIL import Image
from safetensors.torch import save_file
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

model, out, *paths = sys.argv[1:]
cfg = json.load(open(f"{model}/preprocessor_config.json"))
proc = KimiK25FusedVisionProcessor.from_dict(cfg)
tensors = {}
for i, path in enumerate(paths):
    got = proc.preprocess([{"type": "image", "image": Image.open(path).convert("RGB")}], return_tensors="pt")
    tensors[f"pixel_values_{i}"] = got["pixel_values"].contiguous()
    tensors[f"grid_thws_{i}"] = got["grid_thws"].contiguous()
save_file(tensors, out)
"""


def vllm_pixels(vllm_python: str, model_dir, images: dict[str, bytes], folder: Path) -> dict:
    """name -> (pixel_values [N, 3, 14, 14], grid_thw [1, 3]) of each image's bytes, from vLLM's
    Kimi-K2.5 image processor with the model's preprocessor_config.json."""
    from safetensors.torch import load_file

    paths = []
    for i, data in enumerate(images.values()):
        (folder / f"image-{i}").write_bytes(data)
        paths.append(str(folder / f"image-{i}"))
    out = folder / "pixels.safetensors"
    subprocess.run(
        [vllm_python, "-c", _PIXELS, str(model_dir), str(out), *paths], check=True, capture_output=True, timeout=600
    )
    t = load_file(str(out))
    return {name: (t[f"pixel_values_{i}"], t[f"grid_thws_{i}"]) for i, name in enumerate(images)}


def check_image_sample_states(
    store, vllm_python: str, model_dir, merged: dict, images: dict, stored: dict, indices: list[int], folder: Path
) -> None:
    """Each merged image sample's stored aux states (bf16) against transformers' own forward of
    `Kimi_K25ForConditionalGeneration` over its merged ids with vLLM's processor's pixels of its
    stored images (relative error < 1e-2). `merged`/`stored`: sample_id -> merged record / stored
    sample; `images`: the merge's references (read_merged_images); `indices`: the aux layers'
    positions in transformers' `hidden_states`."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    from eagle3_data.images import read_image

    every_image = {r["sha256"]: read_image(store, r) for refs in images.values() for r in refs}
    pixels = vllm_pixels(vllm_python, model_dir, every_image, folder)  # by sha256
    model = Kimi_K25ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for sid, rec in merged.items():
        shas = [r["sha256"] for r in images[sid]]
        with torch.no_grad():
            ref = model.model(
                input_ids=torch.tensor([rec["input_ids"]]),
                pixel_values=torch.cat([pixels[h][0] for h in shas]).float(),
                image_grid_thw=torch.cat([pixels[h][1] for h in shas]),
                output_hidden_states=True,
            ).hidden_states
        s, n = stored[sid], len(rec["input_ids"])
        assert s.input_ids.tolist() == rec["input_ids"], sid
        aux = s.aux_hidden_states.float().reshape(n, len(indices), -1)
        for j, index in enumerate(indices):
            err = float((aux[:, j] - ref[index][0]).abs().max() / ref[index][0].abs().max())
            assert err < 1e-2, (sid, index, err)
