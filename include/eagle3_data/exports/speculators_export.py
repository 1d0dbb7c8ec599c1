"""Export packed shards to vLLM speculators' offline layout, read by its own `ArrowDataset`.

The layout, as speculators 0.9.0 reads it (train/data.py `ArrowDataset`, hs_connectors
transfer.py `FileTransfer` / `FP8Transfer`):
- `{out}/`: a `datasets` `save_to_disk` dataset with `input_ids`, `loss_mask` (int64 lists) and
  `seq_len`, in torch format (what its `prepare-data` writes; `index.jsonl` beside it maps row i
  to our sample_id);
- `{out}/hidden_states/hs_{i}.safetensors` per row i: `hidden_states` bf16 [T, 4, H] (the three
  aux layers, then the last layer's output BEFORE the final norm: the trainer applies its own
  frozen `verifier_norm` to `hidden_states[:, -1]`) and
  `token_ids` int64 [T], equal to the row's input_ids (a mismatch makes the trainer skip the
  sample, train/data.py:314-322);
- fp8 (`fp8=True`, read by `FP8Transfer`): `hidden_states` float8_e4m3fn with
  `hidden_states_scales` float32 [T, 1, 1], one scale per token over all layers
  (hs_connectors fp8_utils.py: scale = amax / 448, clamped at 1e-12).

The ids-only export (exports/ids.py) writes the same dataset from the merged stage alone.
The aux layers are the same tensors in either naming (layers.py: the output of layer i is the
input to layer i+1), so the default extraction exports as it is; `export_info.json` names them
in vLLM's "input to layer i" ids, the ones a speculator's config and vLLM's serving use. A shard
with a post-norm last state is refused: the trainer would normalise it twice, without a word.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3_data.errors import UserError
from eagle3_data.exports.shards import ShardReader

BATCH_TOKENS = 1 << 20  # tokens per Arrow batch of save_rows: 16 MiB of int64 ids + mask
BATCH_ROWS = 4096
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_per_token(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs_connectors' per-token fp8: one float32 scale per token over every other dimension."""
    fp32 = states.float()
    amax = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (fp32 / scale).to(torch.float8_e4m3fn), scale


def vllm_layer_ids(reader: ShardReader) -> list[int]:
    """The shard's aux layers in vLLM's "input to layer i" ids (+1 for the "output" convention)."""
    return [i + 1 for i in reader.layer_ids] if reader.convention == "output" else list(reader.layer_ids)


def _check(reader: ShardReader, path: str | Path) -> None:
    name = Path(path).name
    if not reader.has_last:
        raise UserError(
            f"{name}: no last_hidden_states; speculators needs the last layer's state (extract with --last-hidden)"
        )
    if reader.last_hidden_norm != "pre":
        raise UserError(
            f"{name}: the last state is after the final norm; speculators applies its own verifier_norm "
            "and would normalise it twice (extract with --last-hidden-norm pre)"
        )


def export_speculators(
    shard_paths: Iterable[str | Path],
    out_dir: str | Path,
    *,
    fp8: bool = False,
    images: Mapping[str, list[Any]] | None = None,
    source: str | None = None,
) -> int:
    """Write the dataset and one state file per row; returns the rows written. `images`
    (sample_id -> references) go into `index.jsonl`: its training takes states and ids only.
    `source`: the extraction the shards came from (a folder or an s3:// stage), recorded in
    `export_info.json` with each row's shard in `index.jsonl`, for `check-export`."""
    out = Path(out_dir)
    states_dir = out / "hidden_states"
    states_dir.mkdir(parents=True, exist_ok=True)
    layers: set[tuple[int, ...]] = set()

    def samples() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]]:
        i = 0
        for path in shard_paths:
            reader = ShardReader(path)
            _check(reader, path)
            layers.add(tuple(vllm_layer_ids(reader)))
            if len(layers) > 1:
                raise UserError(
                    f"{Path(path).name}: aux layers {sorted(layers)} differ between shards; re-extract alike"
                )
            for sample in reader:
                ids = sample.input_ids.to(torch.int64)
                T = ids.shape[0]
                stacked = torch.cat(
                    [sample.aux_hidden_states.reshape(T, 3, -1), sample.last_hidden_states.reshape(T, 1, -1)], dim=1
                )
                tensors = {"token_ids": ids.clone()}
                if fp8:
                    tensors["hidden_states"], tensors["hidden_states_scales"] = quantize_per_token(stacked)
                else:
                    tensors["hidden_states"] = stacked.to(torch.bfloat16).contiguous()
                save_file(tensors, str(states_dir / f"hs_{i}.safetensors"))
                i += 1
                yield sample.sample_id, ids, sample.loss_mask, {"shard": Path(path).name}

    n = save_rows(samples(), out, images=images)
    info = {
        "layout": "speculators",
        "samples": n,
        "source": source,
        "hidden_states": {
            "encoding": "fp8_e4m3fn_per_token" if fp8 else "bfloat16",
            "aux_layer_ids_vllm": list(next(iter(layers))),
            "last": "the last layer's output before the final norm",
        },
    }
    (out / "export_info.json").write_text(json.dumps(info, indent=1))
    return n


def save_rows(
    samples: Iterable[tuple[Any, ...]],
    out_dir: str | Path,
    images: Mapping[str, list[Any]] | None = None,
) -> int:
    """The rows as speculators' dataset (`input_ids`, `loss_mask` int64 lists, `seq_len`; torch
    format, what `save_to_disk` writes and `load_from_disk` reads) with `index.jsonl` (row ->
    sample_id); returns the rows written.

    Streams in bounded memory: rows are packed into Arrow record batches of at most
    BATCH_TOKENS tokens (numpy buffers, never a chunk of Python lists) and appended to the
    dataset's one Arrow file as they come, the index written line by line; `state.json` and
    `dataset_info.json` are then written as `save_to_disk` writes them, from the file opened
    memory-mapped (never read: `save_to_disk` would copy it through memory, its pages counted in
    the process's RSS). Peak memory is one batch, whatever the row count (benchmarks/export_memory.py)."""
    import datasets
    import numpy as np
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter
    from datasets.utils.py_utils import asdict  # the one save_to_disk uses

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    schema = features.arrow_schema
    data_file = out / "data-00000-of-00001.arrow"
    n = 0
    with open(out / "index.jsonl", "w") as index, ArrowWriter(features=features, path=str(data_file)) as writer:
        ids_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        tokens = 0

        def flush() -> None:
            nonlocal tokens
            lengths = np.fromiter((len(a) for a in ids_parts), np.int64, len(ids_parts))
            offsets = np.zeros(len(lengths) + 1, np.int32)
            np.cumsum(lengths, out=offsets[1:])
            cols = [
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(parts), pa.int64()))
                for parts in (ids_parts, mask_parts)
            ]
            writer.write_table(pa.Table.from_arrays([*cols, pa.array(lengths)], schema=schema))
            ids_parts.clear()
            mask_parts.clear()
            tokens = 0

        for sample_id, ids, mask, *extra in samples:  # extra: fields of the row's index line (its shard)
            ids, mask = _int64(ids), _int64(mask)
            refs = images.get(sample_id) if images else None  # an image sample's references, for whoever feeds them
            line = {"row": n, "sample_id": sample_id, **(extra[0] if extra else {})}
            index.write(json.dumps({**line, **({"images": refs} if refs else {})}) + "\n")
            ids_parts.append(ids)
            mask_parts.append(mask)
            n += 1
            tokens += len(ids)
            if tokens >= BATCH_TOKENS or len(ids_parts) >= BATCH_ROWS:
                flush()
        if ids_parts:
            flush()
        if not n:
            raise UserError("export-speculators: no samples to export")
        writer.finalize()
    table = datasets.Dataset.from_file(str(data_file))  # memory-mapped: nothing read
    table.set_format(type="torch")
    # what Dataset.save_to_disk writes beside its shards (datasets 5.x), for this one shard
    state = {
        key: table.__dict__[key]
        for key in ("_fingerprint", "_format_columns", "_format_kwargs", "_format_type", "_output_all_columns")
    }
    state["_split"] = str(table.split) if table.split is not None else None
    state["_data_files"] = [{"filename": data_file.name}]
    info = asdict(table._info)
    del table
    with open(out / "state.json", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    with open(out / "dataset_info.json", "w", encoding="utf-8") as f:
        json.dump({key: info[key] for key in sorted(info)}, f, indent=2)
    return n


def _int64(values):
    """`values` (a tensor or a list) as an int64 numpy array."""
    import numpy as np

    if isinstance(values, torch.Tensor):
        return values.to(torch.int64).numpy()
    return np.asarray(values, dtype=np.int64)
