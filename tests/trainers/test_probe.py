"""The probe's verdict: `eagle3-data probe` trains speculators' own EAGLE-3 head on a split of an
export of the tiny target's own generations and reports speculators' own per-position metrics,
the simulated acceptance they imply and the learning curve; bad input is one line (exit 2).

Whether the verdict tells correct data from each injected fault is benchmarks/probe_faults.py's
(RESULTS.md, "The probe"): at the size `make test` affords on 2 cores it does not yet, so no test
asserts that ordering."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3_data.dev.probe_data import export_rows, own_generations, with_trained_norm
from eagle3_data.probe import simulated_acceptance

SAMPLES = 16


@pytest.fixture(scope="module")
def export(tiny_model_dir, tmp_path_factory):
    """(target, its export): 16 of the tiny target's own answers, extracted and exported."""
    import torch

    work = tmp_path_factory.mktemp("probe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: tiny matmuls lose most to thread contention
    try:
        target = with_trained_norm(tiny_model_dir, work / "target")
        return target, export_rows(target, own_generations(target, SAMPLES, new_tokens=32), work / "export")
    finally:
        torch.set_num_threads(threads)


def test_simulated_acceptance_is_the_expected_accepted_prefix():
    """sum_k prod_{i<=k} acc_i against a simulation of the definition: draft k is accepted with
    probability acc_k when every draft before it was; the accepted prefix's mean length."""
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.2, 0.95, size=5)
    right = rng.random((200_000, acc.size)) < acc
    prefix = np.cumprod(right, axis=1).sum(axis=1)
    assert abs(simulated_acceptance(list(acc)) - prefix.mean()) < 0.02


def test_probe_cli_on_an_export(export, tmp_path):
    target, correct = export
    import yaml

    from eagle3_data.config import default_config_raw

    raw = default_config_raw()
    raw["probe"]["max_len"] = 256  # speculators' collation pads every step to max_len: 4,096 costs minutes on CPU
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "probe.json"
    cmd = [
        str(Path(sys.executable).parent / "eagle3-data"),
        "probe",
        "--input",
        str(correct),
        "--model",
        str(target),
        "--steps",
        "4",
        "--samples",
        "12",
        "--eval-samples",
        "3",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--config",
        str(config),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["acc"]) == len(report["full_acc"]) == 3  # the config's draft_length
    assert report["simulated_acceptance"] == pytest.approx(simulated_acceptance(report["acc"]))
    assert [c["step"] for c in report["curve"]] == [0, 4] and len(report["losses"]) == 4
    assert 0 < report["coverage"] <= 1 and report["train_samples"] == 12 and report["eval_samples"] == 3

    bad = subprocess.run([*cmd[:3], str(tmp_path), *cmd[4:]], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "export_info.json" in bad.stderr, bad.stderr
