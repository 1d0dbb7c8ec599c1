"""Ids-only exports of the merged stage, for training online (the trainer runs the target itself),
so a user can train without storing any hidden states.

- speculators: its pretokenized rows, a `save_to_disk` dataset of `input_ids`, `loss_mask`,
  `seq_len` (speculators_export.save_rows): its `prepare-data` passes rows that carry both
  through unchanged (data_generation/preprocessing.py), and its trainer fetches their states
  from a vLLM endpoint (`ArrowDataset(on_missing="generate")`).
- SpecForge: pre-tokenized JSONL, one `{"input_ids": [...], "loss_mask": [...]}` per line: its
  `prepare_prompt_tasks` treats a file whose first record has both as pre-tokenized
  (data/prompt_builder.py) for `data.prompts_path` (online training).
Both carry an `index.jsonl` / `sample_id` back to our rows, and an image sample's references
(`images`, images.py: uri + sha256 of each) for an online trainer that feeds the images.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def export_speculators_ids(
    rows: Iterable[Mapping[str, Any]], out_dir: str | Path, images: Mapping[str, list[Any]] | None = None
) -> int:
    """Merged rows (sample_id, input_ids, loss_mask) as speculators' pretokenized dataset;
    `images` (sample_id -> references, the merge's images.jsonl) go into `index.jsonl`."""
    from eagle3_data.exports.speculators_export import save_rows

    return save_rows(((r["sample_id"], r["input_ids"], r["loss_mask"]) for r in rows), out_dir, images=images)


def export_specforge_ids(
    rows: Iterable[Mapping[str, Any]], out_dir: str | Path, images: Mapping[str, list[Any]] | None = None
) -> int:
    """Merged rows as SpecForge's pre-tokenized JSONL (`prompts.jsonl`, with `sample_id` kept, and
    an image sample's `images` references: its prompt builder passes extra keys through)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "prompts.jsonl", "w") as f:
        for r in rows:
            line = {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "sample_id": r["sample_id"]}
            if images and r["sample_id"] in images:
                line["images"] = images[r["sample_id"]]
            f.write(json.dumps(line) + "\n")
            n += 1
    return n
