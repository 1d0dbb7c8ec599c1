"""Ids-only exports of the merged stage, for training online (the trainer runs the target itself),
so a user can train without storing any hidden states.

- speculators: its pretokenized rows, a `save_to_disk` dataset of `input_ids`, `loss_mask`,
  `seq_len` (speculators_export.save_rows): its `prepare-data` passes rows that carry both
  through unchanged (data_generation/preprocessing.py), and its trainer fetches their states
  from a vLLM endpoint (`ArrowDataset(on_missing="generate")`).
- SpecForge: pre-tokenized JSONL, one `{"input_ids": [...], "loss_mask": [...]}` per line: its
  `prepare_prompt_tasks` treats a file whose first record has both as pre-tokenized
  (data/prompt_builder.py) for `data.prompts_path` (online training).
Both carry an `index.jsonl` / `sample_id` back to our rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path


def export_speculators_ids(rows: Iterable[Mapping], out_dir: str | Path) -> int:
    """Merged rows (sample_id, input_ids, loss_mask) as speculators' pretokenized dataset."""
    from eagle3_data.hidden_states.speculators_export import save_rows

    return save_rows(((r["sample_id"], r["input_ids"], r["loss_mask"]) for r in rows), out_dir)


def export_specforge_ids(rows: Iterable[Mapping], out_dir: str | Path) -> int:
    """Merged rows as SpecForge's pre-tokenized JSONL (`prompts.jsonl`, with `sample_id` kept)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "prompts.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "sample_id": r["sample_id"]}) + "\n")
            n += 1
    return n
