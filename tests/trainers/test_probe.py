"""The probe can fail: drafters trained with speculators' own model, collation and loss on the
tiny target's own generations score (speculators' own per-step accuracy, on the same held-out
rows of the correct export) above every injected fault by more than the correct data's spread
over seeds. And `eagle3-data probe` on an export writes the verdict; bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eagle3_data.config import ProbeConfig
from eagle3_data.dev.probe_data import FAULTS, calibration
from eagle3_data.probe import Arm, simulated_acceptance, split, train_and_score

SAMPLES, SEEDS = 32, 3
CONFIG = ProbeConfig(samples=SAMPLES, eval_samples=8, steps=40, draft_length=3, batch_size=4, max_len=512,
                     eval_every=20)


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir, tmp_path_factory):
    return calibration(tiny_model_dir, tmp_path_factory.mktemp("probe"), SAMPLES)


def test_correct_data_scores_above_every_fault(calibrated):
    target, correct, faulty = calibrated
    train_rows, eval_rows = split(SAMPLES, CONFIG.samples, CONFIG.eval_samples, 0)
    arms = [Arm(f"correct/{s}", correct, correct, train_rows, eval_rows, correct, s) for s in range(SEEDS)]
    arms += [Arm(f, path, correct, train_rows, eval_rows, correct, 0) for f, path in faulty.items()]
    results = {r["name"]: r for r in train_and_score(target, arms, CONFIG)}
    good = [results[f"correct/{s}"]["simulated_acceptance"] for s in range(SEEDS)]
    spread = max(good) - min(good)
    below = {f: min(good) - results[f]["simulated_acceptance"] for f in FAULTS}
    print(f"correct {good} spread {spread:.3f}; below the lowest seed: {below}")
    assert all(np.isfinite(good)) and min(good) > 0, good
    for fault in FAULTS:
        assert below[fault] > spread, (fault, below, good)


def test_simulated_acceptance_is_the_expected_accepted_prefix():
    """sum_k prod_{i<=k} acc_i against a simulation of the definition: draft k is accepted with
    probability acc_k when every draft before it was; the accepted prefix's mean length."""
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.2, 0.95, size=5)
    right = rng.random((200_000, acc.size)) < acc
    prefix = np.cumprod(right, axis=1).sum(axis=1)
    assert abs(simulated_acceptance(list(acc)) - prefix.mean()) < 0.02


def test_probe_cli_on_an_export(calibrated, tmp_path):
    target, correct, _ = calibrated
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "-m", "eagle3_data.cli", "probe", "--input", str(correct), "--model", str(target),
           "--steps", "4", "--samples", "16", "--eval-samples", "4", "--out", str(out), "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["acc"]) == len(report["full_acc"]) == 3  # the config's draft_length
    assert report["simulated_acceptance"] == pytest.approx(simulated_acceptance(report["acc"]))
    assert [c["step"] for c in report["curve"]] == [0, 4] and len(report["losses"]) == 4
    assert 0 < report["coverage"] <= 1 and report["train_samples"] == 16 and report["eval_samples"] == 4

    bad = subprocess.run([*cmd[:5], str(tmp_path), *cmd[6:]], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "export_info.json" in bad.stderr, bad.stderr
