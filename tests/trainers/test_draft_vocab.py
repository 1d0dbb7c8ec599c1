"""The draft vocabulary the merge writes (draft_vocab.py): the trained-token counts of the merged
rows, the top N with deterministic ties, loaded by speculators' and SpecForge's own code in
.venv-speculators; coverage in the manifest."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from eagle3_data import draft_vocab
from eagle3_data.stages.probe.drafter import speculators_python

ORACLE = Path(__file__).with_name("vocab_oracle.py")


def test_top_n_with_ties_broken_by_id_and_filled_with_the_lowest_unused_ids():
    counts = np.zeros(20, dtype=np.int64)
    counts[[7, 3, 12, 15]] = [5, 5, 9, 1]
    assert draft_vocab.select(counts, 3).tolist() == [3, 7, 12]  # 12 (9), then the tie 3 < 7 (5 each)
    assert draft_vocab.select(counts, 2).tolist() == [3, 12]
    assert draft_vocab.select(counts, 6).tolist() == [0, 1, 3, 7, 12, 15]  # all 4 trained, then 0 and 1
    s = draft_vocab.summary(counts, 2, draft_vocab.select(counts, 2))
    assert s == {"size": 2, "requested_size": 2, "trained_tokens": 20, "distinct_trained": 4, "coverage": 14 / 20}


def test_counts_are_the_trained_tokens_only():
    counts = draft_vocab.add_counts(
        np.zeros(4, dtype=np.int64), np.array([1, 2, 2, 9]), np.array([0, 1, 1, 1], np.uint8)
    )
    assert counts.tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 1]  # id 1 is not trained; id 9 grows the table


@pytest.mark.parametrize("n", [6, 40])  # 40: more than the trained tokens
def test_both_trainers_load_the_files_and_agree(tmp_path, n):
    rng = np.random.default_rng(0)
    ids = rng.zipf(1.6, 5000) % 300
    counts = draft_vocab.add_counts(np.zeros(300, dtype=np.int64), ids, (rng.random(5000) < 0.7).astype(np.uint8))
    counts[[11, 12]] = counts[[11, 12]].max()  # a tie
    names, summary = draft_vocab.write(tmp_path, counts, n, 300)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    done = subprocess.run(
        [speculators_python(), str(ORACLE), str(tmp_path), str(min(n, 300)), "300"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["size"] == n and got["speculators_loaded_equals_its_builder"] and got["specforge_equals_speculators"]
    assert got["freq_total"] == int(counts.sum()) == summary["trained_tokens"] and got["d2t_dtype"] == "int64"
