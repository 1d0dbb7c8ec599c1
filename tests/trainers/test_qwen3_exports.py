"""Both trainers' exports of a Qwen3-MoE extraction, read by their own readers, and the probe on one.

The chain of tests/trainers/test_check_export.py on `dev:tiny-qwen3-moe` (a copy with a spread final
norm: with weight 1 a second normalisation changes nothing): the target's own answers after
Qwen3's assistant header, extracted and exported by the CLI (each export checks itself on every
row), then `check_export` runs speculators' ArrowDataset + shift_batch and SpecForge's
OfflineEagle3Dataset in .venv-speculators and compares each trained state, through the target's
final norm and LM head, with the log-probability the extraction recorded. A state one position
late fails both. Both trainers' Qwen3 configs name the same aux layers as the defaults
(SpecForge's outputs [1, L//2-1, L-4], speculators' inputs [2, L//2, L-3]).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_data import draft_vocab
from eagle3_data.cli import main
from eagle3_data.dev.probe_data import assistant_header, own_generations, with_trained_norm
from eagle3_data.exports.check import ExportCheckFailed, LocalShards, check_export
from eagle3_data.exports.shards import ShardReader
from tests.trainers.test_check_export import sf_fault, spec_fault

VOCAB = 64
SAMPLES = 6
PROMPT_TOKENS = 16


def write_merged(rows: list[dict], folder) -> None:
    """The merge stage's parquet columns for these rows (the extract CLI's input)."""
    folder.mkdir()
    n = len(rows)
    table = pa.table(
        {
            "sample_id": [r["sample_id"] for r in rows],
            "dataset": ["chat"] * n,
            "source": ["local"] * n,
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.uint8())),
            "prompt_tokens": pa.array([PROMPT_TOKENS] * n, pa.int32()),
            "output_tokens": pa.array([len(r["input_ids"]) - PROMPT_TOKENS for r in rows], pa.int32()),
            "truncated": [False] * n,
            "finish_reason": ["length"] * n,
            "provenance": [None] * n,
        }
    )
    pq.write_table(table, folder / "shard-00000.parquet")


@pytest.fixture(scope="module")
def chain(tiny_qwen3_moe_dir, tmp_path_factory):
    """(target, {layout: export folder}, shard folder): the CLI's chain over the target's answers."""
    work = tmp_path_factory.mktemp("qwen3-exports")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = with_trained_norm(tiny_qwen3_moe_dir, work / "target")
        header = assistant_header(target)
        rows = own_generations(target, SAMPLES, prompt_tokens=PROMPT_TOKENS, new_tokens=20, header=header)
    finally:
        torch.set_num_threads(threads)
    assert all(r["input_ids"][PROMPT_TOKENS - len(header) : PROMPT_TOKENS] == header for r in rows)
    write_merged(rows, work / "merged")
    counts = np.zeros(0, dtype=np.int64)
    for r in rows:
        counts = draft_vocab.add_counts(counts, np.array(r["input_ids"]), np.array(r["loss_mask"], np.uint8))
    vocab = work / "vocab"
    vocab.mkdir()
    draft_vocab.write(vocab, counts, VOCAB, json.loads((target / "config.json").read_text())["vocab_size"])
    shards = work / "shards"
    assert main(["extract", "--input", str(work / "merged"), "--out", str(shards), "--model", str(target)]) == 0
    exports = {}
    for layout in ("speculators", "specforge"):
        out = work / layout
        argv = [f"export-{layout}", "--input", str(shards), "--out", str(out), "--draft-vocab", str(vocab)]
        assert main([*argv, "--model", str(target), "--all"]) == 0  # the export's own check, every row
        exports[layout] = out
    return target, exports, shards


def _check(chain, layout: str, export=None) -> dict:
    target, exports, shards = chain
    return check_export(
        export or exports[layout], target, LocalShards(sorted(shards.glob("*.safetensors"))), samples=None
    )


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_a_qwen3_export_passes_through_its_trainers_reader(chain, layout):
    result = _check(chain, layout)
    assert result["verdict"] == "pass" and result["rows_checked"] == SAMPLES, result
    assert result["trained_positions"] >= SAMPLES * 18 and result["aux_values_compared"] > 0, result
    assert result["draft_vocab"]["size"] == VOCAB, result
    reader = ShardReader(next(chain[2].glob("*.safetensors")))
    assert (reader.convention, reader.layer_ids) == ("output", [1, 3, 4])  # SpecForge's naming, of 8 layers
    if layout == "speculators":  # the same tensors in speculators' naming: inputs of layers [2, 4, 5]
        info = json.loads((chain[1][layout] / "export_info.json").read_text())
        assert info["hidden_states"]["aux_layer_ids_vllm"] == [2, 4, 5]


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_a_state_one_position_late_fails_on_qwen3(chain, layout, tmp_path):
    target, exports, _ = chain
    export = shutil.copytree(exports[layout], tmp_path / "late")
    if layout == "speculators":
        spec_fault("states_late", export, target)
    else:
        sf_fault("states_late", export, target, exports["speculators"])
    with pytest.raises(ExportCheckFailed, match="sample 's.*position"):
        _check(chain, layout, export)


def test_the_probe_trains_on_a_qwen3_export(chain, tmp_path):
    """speculators' EAGLE-3 head on the Qwen3 target's export: the probe's verdict passes (the
    export check inside it, the last-state fit against the target's own forward)."""
    import yaml

    from eagle3_data.config import default_config_raw

    target, exports, _ = chain
    raw = default_config_raw()
    raw["probe"].update(max_len=128, steps=2, eval_every=2, samples=5, eval_samples=1, seeds=2)
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "probe.json"
    argv = ["probe", "--input", str(exports["speculators"]), "--model", str(target), "--device", "cpu"]
    assert main([*argv, "--config", str(config), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == "pass" and "export check passed" in report["verdict_rule"], report["verdict_rule"]
    assert len(report["seed_runs"]) == 2
