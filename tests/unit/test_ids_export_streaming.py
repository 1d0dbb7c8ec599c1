"""The ids-only speculators export streams (speculators_export.save_rows): the dataset it writes
in bounded Arrow batches is the one a single `Dataset.from_list` of every row would write."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")


def test_save_rows_in_batches_writes_what_one_table_would(tmp_path, monkeypatch):
    from eagle3_data.exports import speculators_export as speculators_export

    rng = np.random.default_rng(0)
    rows = []
    for i in range(37):
        n = int(rng.integers(1, 40))
        ids = rng.integers(0, 163_840, n).tolist()
        mask = rng.integers(0, 2, n).tolist()
        # what the callers pass: Python lists (merged rows), torch tensors (shards), numpy arrays
        rows.append(
            (
                f"s{i}",
                [ids, torch.tensor(ids, dtype=torch.int32), np.array(ids)][i % 3],
                [mask, torch.tensor(mask, dtype=torch.bool), np.array(mask, np.uint8)][i % 3],
                ids,
                mask,
            )
        )
    monkeypatch.setattr(speculators_export, "BATCH_TOKENS", 50)  # many batches, some of one row
    monkeypatch.setattr(speculators_export, "BATCH_ROWS", 4)
    n = speculators_export.save_rows(((sid, ids, mask) for sid, ids, mask, _, _ in rows), tmp_path / "out")
    assert n == len(rows)

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    whole = datasets.Dataset.from_list(
        [{"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)} for *_, ids, mask in rows], features=features
    )
    got = datasets.load_from_disk(str(tmp_path / "out"))
    assert got.features == whole.features and got.format["type"] == "torch"
    assert got.with_format(None).to_dict() == whole.to_dict()
    assert [json.loads(line) for line in (tmp_path / "out" / "index.jsonl").read_text().splitlines()] == [
        {"row": i, "sample_id": f"s{i}"} for i in range(len(rows))
    ]
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # nothing written beside the dataset


def test_save_rows_refuses_nothing_to_export(tmp_path):
    from eagle3_data.errors import UserError
    from eagle3_data.exports.speculators_export import save_rows

    with pytest.raises(UserError, match="no samples"):
        save_rows(iter(()), tmp_path / "out")
