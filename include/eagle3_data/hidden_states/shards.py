"""Packed hidden-state shards: many samples per safetensors file, no padding stored.

Layout (ARCHITECTURE.md): `input_ids` int32 [N], `loss_mask` uint8 [N], `offsets` int64 [S+1]
(sample s is rows offsets[s]:offsets[s+1]), `aux_hidden_states` [N, 3H] in bf16 (or fp8 e4m3 +
`aux_hidden_states_scale` float32 [N, 3]), optional `last_hidden_states` bf16 [N, H]; metadata
`layer_ids`, `convention`, `model`, `dtype` (the forward's compute dtype), `sample_ids`.
Thousands of samples per file instead of one file each, and a reader that slices one sample
out through safetensors' lazy slices without reading the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_data.errors import UserError
from eagle3_data.hidden_states import fp8

FORMAT = "eagle3-packed-hidden-states"
FORMAT_VERSION = "1"


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden_states: torch.Tensor  # [T, 3H]
    last_hidden_states: torch.Tensor | None = None  # [T, H]


def write_shard(path: str | Path, samples: list[Sample], *, layer_ids: list[int], convention: str, model: str,
                dtype: str, use_fp8: bool = False) -> int:
    """Write one packed shard; returns its size in bytes."""
    if not samples:
        raise ValueError("refusing to write an empty shard")
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    aux = torch.cat([s.aux_hidden_states for s in samples])
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "offsets": offsets,
    }
    if use_fp8:
        tensors["aux_hidden_states"], tensors["aux_hidden_states_scale"] = fp8.quantize_rows(aux, len(layer_ids))
    else:
        tensors["aux_hidden_states"] = aux.to(torch.bfloat16).contiguous()
    if samples[0].last_hidden_states is not None:
        tensors["last_hidden_states"] = torch.cat([s.last_hidden_states for s in samples]).to(torch.bfloat16)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layer_ids": json.dumps(layer_ids),
        "convention": convention,
        "model": model,
        "dtype": dtype,
        "aux_encoding": "fp8_e4m3_row_scale" if use_fp8 else "bf16",
        "sample_ids": json.dumps([s.sample_id for s in samples]),
    }
    save_file(tensors, str(path), metadata=metadata)
    return Path(path).stat().st_size


class ShardReader:
    """Per-sample access to a packed shard; only offsets and metadata are read up front."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        meta = self._file.metadata() or {}
        if meta.get("format") != FORMAT:
            raise UserError(f"{self.path}: not a packed hidden-state shard (metadata format={meta.get('format')!r})")
        self.metadata = meta
        self.layer_ids: list[int] = json.loads(meta["layer_ids"])
        self.convention = meta["convention"]
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.offsets = self._file.get_tensor("offsets")
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}
        self.has_last = "last_hidden_states" in self._file.keys()
        self.is_fp8 = meta.get("aux_encoding") == "fp8_e4m3_row_scale"

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def _rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._file.get_slice(name)[start:end]

    def get(self, sample_id: str) -> Sample:
        if sample_id not in self._index:
            raise KeyError(f"sample {sample_id!r} not in {self.path.name}")
        return self.sample(self._index[sample_id])

    def sample(self, i: int) -> Sample:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        aux = self._rows("aux_hidden_states", start, end)
        if self.is_fp8:
            aux = fp8.dequantize_rows(aux, self._rows("aux_hidden_states_scale", start, end))
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=self._rows("input_ids", start, end),
            loss_mask=self._rows("loss_mask", start, end),
            aux_hidden_states=aux,
            last_hidden_states=self._rows("last_hidden_states", start, end) if self.has_last else None,
        )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.sample(i)
