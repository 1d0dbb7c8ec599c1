"""export-speculators, read by vLLM speculators' OWN dataset code (speculators 0.9.0's ArrowDataset
in .venv-speculators, `make speculators-venv`): every sample loads, ids and states bit-exact
against our shards, bf16 and fp8; shards it would misread are refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.errors import UserError
from eagle3_data.exports.shards import ShardReader
from eagle3_data.exports.speculators_export import export_speculators, quantize_per_token
from eagle3_data.stages.hidden_states.backends import TransformersBackend
from eagle3_data.stages.hidden_states.extract import extract_rows
from eagle3_data.stages.probe.drafter import speculators_python

READER = Path(__file__).with_name("speculators_reader.py")


@pytest.fixture(scope="module")
def shards(tiny_kimi_k25_dir, tmp_path_factory) -> list[Path]:
    """The tiny model's states as the DAG extracts them by default (output naming, last state before the norm)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i, n in enumerate([5, 33, 12, 47]):
        ids = torch.randint(0, 163_840, (n,), generator=g).tolist()
        rows.append({"sample_id": f"s{i}", "input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
    out = tmp_path_factory.mktemp("spec-shards")
    extract_rows(
        TransformersBackend(tiny_kimi_k25_dir), rows, out, "x", HiddenStatesConfig(batch_tokens=48, shard_tokens=40)
    )
    return sorted(out.glob("*.safetensors"))


def read_with_speculators(export: Path, kind: str, out: Path) -> list[dict]:
    done = subprocess.run(
        [speculators_python(), str(READER), str(export), kind, str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [load_file(str(out / f"{i}.safetensors")) for i in range(int(done.stdout.split()[-1]))]


def ours(shards: list[Path]) -> list:
    return [s for p in shards for s in ShardReader(p)]


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_speculators_reads_every_sample_bit_exact(shards, tmp_path, kind):
    n = export_speculators(shards, tmp_path / "export", fp8=kind == "fp8")
    loaded, expected = read_with_speculators(tmp_path / "export", kind, tmp_path / "read"), ours(shards)
    assert n == len(loaded) == len(expected) == 4 and len(shards) > 1
    index = [json.loads(line) for line in (tmp_path / "export" / "index.jsonl").read_text().splitlines()]
    info = json.loads((tmp_path / "export" / "export_info.json").read_text())
    assert info["hidden_states"]["aux_layer_ids_vllm"] == [2, 4, 5]  # output of layers [1, 3, 4] of 8
    assert [e["sample_id"] for e in index] == [s.sample_id for s in expected]
    for got, s in zip(loaded, expected):
        T = s.input_ids.shape[0]
        assert torch.equal(got["input_ids"], s.input_ids.long()) and torch.equal(
            got["loss_mask"].long(), s.loss_mask.long()
        )
        states = torch.cat([s.aux_hidden_states.reshape(T, 3, -1), s.last_hidden_states.reshape(T, 1, -1)], 1)
        if kind == "fp8":  # exactly the reader's dequantisation of our quantisation, and close to the states
            q, scale = quantize_per_token(states)
            dequantised = q.to(torch.bfloat16) * scale.to(torch.bfloat16)
            assert float((dequantised.float() - states.float()).norm() / states.float().norm()) < 0.05
            states = dequantised
        assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == (T, 3 * 64)
        assert torch.equal(got["hidden_states"], states[:, :3].flatten(1))
        assert torch.equal(
            got["verifier_last_hidden_states"], states[:, 3]
        )  # before the norm: the trainer applies its own


def test_ids_only_exports_are_the_trainers_pretokenized_rows(tmp_path):
    """From the merged rows alone: speculators' dataset as its `load_from_disk` reads it, and
    SpecForge's JSONL as its own `prepare_prompt_tasks` takes it (pre-tokenized, no tokenizer)."""
    from eagle3_data.exports.ids import export_specforge_ids, export_speculators_ids

    rows = [
        {"sample_id": f"m{i}", "input_ids": list(range(5 + i)), "loss_mask": [0, 0] + [1] * (3 + i)} for i in range(4)
    ]
    images = {
        "m1": [
            {
                "uri": "s3://b/images/sha256/" + "a" * 64,
                "sha256": "a" * 64,
                "bytes": 9,
                "width": 2,
                "height": 2,
                "media_tokens": 1,
            }
        ]
    }
    assert (
        export_speculators_ids(rows, tmp_path / "spec", images) == 4
        and not (tmp_path / "spec" / "hidden_states").exists()
    )
    assert export_specforge_ids(rows, tmp_path / "sf", images) == 4
    # an image sample's references travel beside its ids (for an online trainer that feeds them)
    index = [json.loads(line) for line in (tmp_path / "spec" / "index.jsonl").read_text().splitlines()]
    lines = [json.loads(line) for line in (tmp_path / "sf" / "prompts.jsonl").read_text().splitlines()]
    assert [e.get("images") for e in index] == [x.get("images") for x in lines] == [None, images["m1"], None, None]
    code = (
        "import sys, json, datasets\n"
        "from specforge.data.prompt_builder import prepare_prompt_tasks\n"
        "d = datasets.load_from_disk(sys.argv[1])\n"
        "tasks = prepare_prompt_tasks(sys.argv[2], None, chat_template=None, max_length=64, is_preformatted=False,\n"
        "    train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)\n"
        "print(json.dumps({'columns': d.column_names, 'format': d.format['type'],\n"
        "    'ids': [x.tolist() for x in d['input_ids']],\n"
        "    'seq_len': [int(x) for x in d['seq_len']], 'specforge': [dict(t['payload']) for t in tasks]}))"
    )
    done = subprocess.run(
        [speculators_python(), "-c", code, str(tmp_path / "spec"), str(tmp_path / "sf" / "prompts.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert (got["columns"], got["format"]) == (["input_ids", "loss_mask", "seq_len"], "torch")
    assert got["ids"] == [r["input_ids"] for r in rows] and got["seq_len"] == [len(r["input_ids"]) for r in rows]
    assert [(p["input_ids"], p["loss_mask"]) for p in got["specforge"]] == [
        (r["input_ids"], r["loss_mask"]) for r in rows
    ]


def test_shards_speculators_would_misread_are_refused(tiny_kimi_k25_dir, shards, tmp_path):
    rows = [{"sample_id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}]
    backend = TransformersBackend(tiny_kimi_k25_dir)
    for options, why in [
        (HiddenStatesConfig(last_hidden_norm="post"), "normalise it twice"),
        (HiddenStatesConfig(last_hidden=False), "no last_hidden_states"),
    ]:
        out = tmp_path / why.replace(" ", "_").replace("'", "")
        extract_rows(backend, rows, out, "x", options)
        with pytest.raises(UserError, match=why):
            export_speculators(sorted(out.glob("*.safetensors")), tmp_path / "refused")
