"""Export packed shards to SpecForge's offline layout, so users can train with SpecForge today.

SpecForge's `OfflineEagle3Dataset` walks a directory for `*.ckpt` files, each a `torch.save`
dict of one sample: `input_ids` [T], `loss_mask` [T], `hidden_state` [1, T, H] (the final-norm
state its trainer feeds to the target's LM head: a state stored before the norm gets the final
norm recorded with its shard applied here) and `aux_hidden_state` [1, T, 3H]. Files are
grouped `rows_{start}-{end}/data_{i}.ckpt` as its own `prepare_hidden_states.py` writes them;
`index.jsonl` maps each file back to its sample_id. The format holds no images: an image sample
is left out, named in `left_out.jsonl` with why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from eagle3_data.errors import UserError
from eagle3_data.exports.shards import ShardReader
from eagle3_data.images import LEFT_OUT_FILE, NO_IMAGES_IN_FORMAT
from eagle3_data.target_head.final_norm import rms_norm

GROUP_SIZE = 5000


def export_specforge(
    shard_paths: Iterable[str | Path],
    out_dir: str | Path,
    images: Mapping[str, list[Any]] | None = None,
    source: str | None = None,
) -> int:
    """Write one .ckpt per sample; returns the number of samples written. The samples in `images`
    (sample_id -> references) are left out, each a line of `left_out.jsonl` (sample_id, reason).
    `source`: the extraction the shards came from, recorded in `export_info.json` (written last)
    with each row's shard in `index.jsonl`, for `check-export`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    dtypes: set[str] = set()
    (out / LEFT_OUT_FILE).unlink(missing_ok=True)
    (out / "export_info.json").unlink(missing_ok=True)
    with open(out / "index.jsonl", "w") as index:
        for path in shard_paths:
            reader = ShardReader(path)
            if reader.convention != "output":
                raise UserError(
                    f"{Path(path).name}: convention {reader.convention!r}; SpecForge expects aux layers in the "
                    "'output of layer i' convention (re-extract with --convention output)"
                )
            if not reader.has_last:
                raise UserError(
                    f"{Path(path).name}: no last_hidden_states; SpecForge needs them (extract with --last-hidden)"
                )
            pre = reader.last_hidden_norm == "pre"
            dtypes.add(str(reader.dtype).removeprefix("torch."))
            if pre and reader.final_norm is None:
                raise UserError(
                    f"{Path(path).name}: last state before the final norm, but no final_norm_weight recorded"
                )
            for sample in reader:
                if images and sample.sample_id in images:
                    with open(out / LEFT_OUT_FILE, "a") as left:
                        left.write(json.dumps({"sample_id": sample.sample_id, "reason": NO_IMAGES_IN_FORMAT}) + "\n")
                    continue
                last = rms_norm(sample.last_hidden_states, *reader.final_norm) if pre else sample.last_hidden_states
                group = count // GROUP_SIZE * GROUP_SIZE
                rel = f"rows_{group}-{group + GROUP_SIZE}/data_{count}.ckpt"
                (out / rel).parent.mkdir(exist_ok=True)
                torch.save(
                    {
                        "input_ids": sample.input_ids.to(torch.long),
                        "loss_mask": sample.loss_mask.to(torch.long),
                        "hidden_state": last.unsqueeze(0).clone(),
                        "aux_hidden_state": sample.aux_hidden_states.unsqueeze(0).clone(),
                    },
                    out / rel,
                )
                index.write(json.dumps({"file": rel, "sample_id": sample.sample_id, "shard": Path(path).name}) + "\n")
                count += 1
    info = {
        "layout": "specforge",
        "samples": count,
        "source": source,
        "hidden_states": {"dtype": "/".join(sorted(dtypes)), "last": "after the final norm (hidden_state)"},
    }
    (out / "export_info.json").write_text(json.dumps(info, indent=1))
    return count
