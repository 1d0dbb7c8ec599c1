"""A drafter trains on our data: speculators' EAGLE-3 draft model, its collation (with its
EAGLE-3 shift) and its KL loss to the target's distribution, on CPU, over the tiny target's
export-speculators output with the draft vocabulary. The loss must fall. The target is the
packaged default's, the tiny Kimi-K2.5: speculators takes a vision-language verifier's sizes from its
`text_config` and its embeddings, LM head and norm under `language_model.`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import torch

from eagle3_data import draft_vocab
from eagle3_data.config import HiddenStatesConfig
from eagle3_data.exports.speculators_export import export_speculators
from eagle3_data.stages.hidden_states.backends import TransformersBackend
from eagle3_data.stages.hidden_states.extract import extract_rows

REPO = Path(__file__).resolve().parents[2]
# The venv's own interpreter, started cold: the one test that proves `make speculators-venv`'s
# python imports speculators by itself (every other speculators script runs in a process forked
# from a warm one, tests/speculators_fork.py).
SPEC_PY = REPO / ".venv-speculators" / "bin" / "python"
TRAIN = Path(__file__).with_name("speculators_train.py")
STEPS, DRAFT_VOCAB = 30, 512


def test_speculators_drafter_trains_on_the_export(tiny_kimi_k25_dir, tmp_path):
    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "sample_id": f"s{i}",
            "input_ids": torch.randint(0, 2000, (48,), generator=g).tolist(),
            "loss_mask": [0] * 16 + [1] * 32,
        }
        for i in range(32)
    ]
    extract_rows(TransformersBackend(tiny_kimi_k25_dir), rows, tmp_path / "shards", "x", HiddenStatesConfig())
    export = tmp_path / "export"
    export_speculators(sorted((tmp_path / "shards").glob("*.safetensors")), export)
    counts = np.zeros(0, dtype=np.int64)
    for r in rows:
        counts = draft_vocab.add_counts(counts, np.array(r["input_ids"]), np.array(r["loss_mask"], np.uint8))
    draft_vocab.write(export, counts, DRAFT_VOCAB, 163_840)
    done = subprocess.run(
        [str(SPEC_PY), str(TRAIN), str(export), str(tiny_kimi_k25_dir), str(STEPS), str(DRAFT_VOCAB)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(done.stdout.splitlines()[-1])["losses"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.5 * first, losses  # measured: ~34 -> ~6 (seeded, CPU)
