"""`eagle3-data check-export`: both layouts read back by their trainers' own code (speculators'
ArrowDataset + shift_batch, SpecForge's OfflineEagle3Dataset + its TargetHead shift, in
.venv-speculators), each trained state put through the target's final norm and LM head and
compared with the log-probability the extraction recorded for the token it is paired with.

The exports are built with the CLI chain (extract, then export-speculators / export-specforge,
which check themselves by default) from the tiny target's own answers, on a copy of the target
whose final norm has spread weights (dev.probe_data.with_trained_norm: with the random init's
weight 1 a second normalisation changes nothing, so no check could see it). The faults are
written into copies of the exports by the code below, which reads and writes the trainers'
files directly and imports none of the exporters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_data import draft_vocab
from eagle3_data.cli import main
from eagle3_data.dev.probe_data import own_generations, with_trained_norm
from eagle3_data.exports.check import ExportCheckFailed, LocalShards, check_export

VOCAB = 64


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    """(target, {name: export folder}, {name: shard folder}): the CLI's chain over 6 answers."""
    work = tmp_path_factory.mktemp("check-export")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = with_trained_norm(tiny_model_dir, work / "target")
        rows = own_generations(target, 6, prompt_tokens=10, new_tokens=20)
    finally:
        torch.set_num_threads(threads)
    merged = work / "merged"
    merged.mkdir()
    n = len(rows)
    table = pa.table(
        {
            "sample_id": [r["sample_id"] for r in rows],
            "dataset": ["chat"] * n,
            "source": ["local"] * n,
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.uint8())),
            "prompt_tokens": pa.array([10] * n, pa.int32()),
            "output_tokens": pa.array([len(r["input_ids"]) - 10 for r in rows], pa.int32()),
            "truncated": [False] * n,
            "finish_reason": ["length"] * n,
            "provenance": [None] * n,
        }
    )
    pq.write_table(table, merged / "shard-00000.parquet")
    counts = np.zeros(0, dtype=np.int64)
    for r in rows:
        counts = draft_vocab.add_counts(counts, np.array(r["input_ids"]), np.array(r["loss_mask"], np.uint8))
    vocab = work / "vocab"
    vocab.mkdir()
    draft_vocab.write(vocab, counts, VOCAB, json.loads((target / "config.json").read_text())["vocab_size"])
    shards = {"bf16": work / "shards-bf16", "fp8": work / "shards-fp8"}
    for kind, out in shards.items():
        flags = ["--fp8"] if kind == "fp8" else []
        assert main(["extract", "--input", str(merged), "--out", str(out), "--model", str(target), *flags]) == 0
    exports = {}
    for name, command, src, flags in (
        ("speculators-bf16", "export-speculators", "bf16", []),
        ("speculators-fp8", "export-speculators", "bf16", ["--fp8"]),
        ("specforge-bf16", "export-specforge", "bf16", []),
        ("specforge-fp8", "export-specforge", "fp8", []),
    ):
        out = work / name
        argv = [command, "--input", str(shards[src]), "--out", str(out), "--draft-vocab", str(vocab)]
        assert main([*argv, "--model", str(target), "--all", *flags]) == 0  # the export's own check, every row
        exports[name] = out
    return target, exports, shards


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _check(chain, name: str, export: Path | None = None) -> dict:
    target, exports, shards = chain
    src = "fp8" if name == "specforge-fp8" else "bf16"
    return check_export(
        export or exports[name], target, LocalShards(sorted(shards[src].glob("*.safetensors"))), samples=None
    )


def _norm(x: torch.Tensor, target: Path) -> torch.Tensor:
    """The target's final RMSNorm, written out here (DeepSeek-V3's: fp32 statistics)."""
    weights = load_file(str(target / "model.safetensors"))
    eps = json.loads((target / "config.json").read_text())["rms_norm_eps"]
    h = x.float()
    return (weights["model.norm.weight"].float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# --- faults written into a speculators export: hidden_states/hs_{i}.safetensors, the Arrow rows ---


def _spec_states(export: Path, row: int) -> dict:
    return load_file(str(export / "hidden_states" / f"hs_{row}.safetensors"))


def _spec_rows(export: Path) -> int:
    return len(list((export / "hidden_states").glob("hs_*.safetensors")))


def _spec_edit(export: Path, edit) -> None:
    for row in range(_spec_rows(export)):
        tensors = _spec_states(export, row)
        edit(row, tensors)
        save_file(tensors, str(export / "hidden_states" / f"hs_{row}.safetensors"))


def _move(t: torch.Tensor, by: int) -> torch.Tensor:
    out = t.clone()
    if by > 0:
        out[by:] = t[:-by]
    else:
        out[:by] = t[-by:]
    return out


def spec_fault(fault: str, export: Path, target: Path) -> None:
    def moved(by):
        def edit(row, t):
            t["hidden_states"] = _move(t["hidden_states"], by)
            if "hidden_states_scales" in t:
                t["hidden_states_scales"] = _move(t["hidden_states_scales"], by)

        return edit

    if fault in ("states_late", "states_early"):
        _spec_edit(export, moved(1 if fault == "states_late" else -1))
    elif fault == "aux_order":
        _spec_edit(export, lambda row, t: t.update(hidden_states=t["hidden_states"][:, [1, 0, 2, 3]].contiguous()))
    elif fault == "other_sample":
        originals = [_spec_states(export, row) for row in range(_spec_rows(export))]

        def other(row, t):
            donor = originals[(row + 1) % len(originals)]
            assert donor["hidden_states"].shape == t["hidden_states"].shape  # same lengths: only states move
            for key in ("hidden_states", "hidden_states_scales"):
                if key in t:
                    t[key] = donor[key].clone()

        _spec_edit(export, other)
    elif fault == "norm_flipped":  # the post-norm state where speculators expects the pre-norm one

        def normed(row, t):
            if "hidden_states_scales" not in t:
                t["hidden_states"][:, 3].copy_(_norm(t["hidden_states"][:, 3], target))
                return
            # fp8: hs_connectors' layout written out here: one float32 scale per token over its 4 layers
            states = t["hidden_states"].float() * t["hidden_states_scales"]
            states[:, 3] = _norm(states[:, 3], target)
            scale = (states.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
            t["hidden_states"], t["hidden_states_scales"] = (states / scale).to(torch.float8_e4m3fn), scale

        _spec_edit(export, normed)
    elif fault == "mask_shifted":
        import datasets

        table = datasets.load_from_disk(str(export)).with_format(None)
        masks = [list(m) for m in table["loss_mask"]]
        shifted = table.remove_columns("loss_mask").add_column("loss_mask", [[0] + m[:-1] for m in masks])
        shifted = shifted.cast(table.features).with_format("torch")  # as speculators' prepare-data saves it
        tmp = export.with_name(export.name + "-rows")
        shifted.save_to_disk(str(tmp))
        for f in ("data-00000-of-00001.arrow", "state.json", "dataset_info.json"):
            (export / f).unlink(missing_ok=True)
        for f in tmp.iterdir():
            shutil.move(str(f), export / f.name)
    elif fault == "vocab_off_by_one":
        (d2t,) = export.glob("d2t-*.npy")
        np.save(d2t, np.load(d2t) + 1)
    else:
        raise AssertionError(fault)


# --- faults written into a SpecForge export: rows_*/data_*.ckpt (torch.save dicts) ---


def sf_fault(fault: str, export: Path, target: Path, speculators: Path) -> None:
    index = [json.loads(line) for line in (export / "index.jsonl").read_text().splitlines()]
    files = [export / e["file"] for e in index]
    data = [torch.load(f, weights_only=False) for f in files]
    if fault in ("states_late", "states_early"):
        by = 1 if fault == "states_late" else -1
        for d in data:
            for key in ("hidden_state", "aux_hidden_state"):
                d[key] = _move(d[key][0], by)[None]
    elif fault == "aux_order":
        for d in data:
            a, b, c = d["aux_hidden_state"].chunk(3, dim=-1)
            d["aux_hidden_state"] = torch.cat([b, a, c], dim=-1).contiguous()
    elif fault == "other_sample":
        donors = [(d["hidden_state"].clone(), d["aux_hidden_state"].clone()) for d in data]
        for i, d in enumerate(data):
            d["hidden_state"], d["aux_hidden_state"] = donors[(i + 1) % len(donors)]
    elif fault == "norm_flipped":  # the pre-norm state where SpecForge expects the normed one
        spec_rows = {
            json.loads(line)["sample_id"]: json.loads(line)["row"] for line in (speculators / "index.jsonl").open()
        }
        for e, d in zip(index, data):
            pre = _spec_states(speculators, spec_rows[e["sample_id"]])["hidden_states"][:, 3]
            d["hidden_state"] = pre[None].to(d["hidden_state"].dtype).clone()
    elif fault == "mask_shifted":
        for d in data:
            d["loss_mask"] = _move(d["loss_mask"], 1)
            d["loss_mask"][0] = 0
    elif fault == "vocab_off_by_one":
        (path,) = export.glob("vocab_mapping-*.pt")
        mapping = torch.load(path)
        torch.save({"d2t": mapping["d2t"] + 1, "t2d": mapping["t2d"]}, path)
        return
    else:
        raise AssertionError(fault)
    for f, d in zip(files, data):
        torch.save(d, f)


FAULTS = (
    "states_late",
    "states_early",
    "aux_order",
    "other_sample",
    "norm_flipped",
    "mask_shifted",
    "vocab_off_by_one",
)


@pytest.mark.parametrize("name", ["speculators-bf16", "speculators-fp8", "specforge-bf16", "specforge-fp8"])
def test_the_correct_export_passes_through_its_trainers_reader(chain, name):
    result = _check(chain, name)
    assert result["verdict"] == "pass" and result["rows_checked"] == 6 and result["trained_positions"] > 60, result
    assert result["aux_values_compared"] > 0 and result["draft_vocab"]["size"] == VOCAB, result
    print(name, json.dumps({k: result[k] for k in ("state_dtype", "logprob", "trained_positions")}))


@pytest.mark.parametrize("name", ["speculators-bf16", "speculators-fp8", "specforge-bf16", "specforge-fp8"])
def test_every_fault_fails_naming_sample_and_position(chain, name, tmp_path):
    target, exports, _ = chain
    layout = name.split("-")[0]
    for fault in FAULTS:
        export = _copy(exports[name], tmp_path / fault)
        if layout == "speculators":
            spec_fault(fault, export, target)
        else:
            sf_fault(fault, export, target, exports["speculators-bf16"])
        with pytest.raises(ExportCheckFailed) as failed:
            _check(chain, name, export)
        message = str(failed.value)
        if fault == "vocab_off_by_one":
            assert "draft vocabulary" in message and "draft id" in message, (fault, message)
        else:
            assert "sample 's" in message and "position" in message, (fault, message)
        print(name, fault, "->", message)


def test_the_cli_exits_1_on_a_fault_and_2_on_bad_input(chain, tmp_path, capsys):
    target, exports, _shards = chain
    export = _copy(exports["specforge-bf16"], tmp_path / "late")
    sf_fault("states_late", export, target, exports["speculators-bf16"])
    assert main(["check-export", "--input", str(export), "--model", str(target), "--all"]) == 1
    err = capsys.readouterr().err
    assert "sample 's" in err and "position" in err and len(err.strip().splitlines()) == 1, err
    assert main(["check-export", "--input", str(exports["speculators-bf16"]), "--model", str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "pass"
    (export / "export_info.json").unlink()
    assert main(["check-export", "--input", str(export), "--model", str(target)]) == 2
    assert "export_info.json" in capsys.readouterr().err


def test_the_probes_verdict_fails_states_moved_by_one_and_passes_the_correct_export(chain, tmp_path):
    """probe.json's verdict: alignment from the export check (the export names the extraction it
    came from) and the last-state fit; data quality from the seeds' spread. Every state one position
    late scores a drafter as well as the correct data on a probe this short, and is refused."""
    import yaml

    from eagle3_data.config import default_config_raw

    target, exports, _ = chain
    raw = default_config_raw()
    raw["probe"].update(max_len=128, steps=2, eval_every=2, samples=5, eval_samples=1, seeds=2)
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(raw))
    late = _copy(exports["speculators-bf16"], tmp_path / "late")
    spec_fault("states_late", late, target)
    reports = {}
    for name, export in (("correct", exports["speculators-bf16"]), ("late", late)):
        out = tmp_path / f"{name}.json"
        argv = ["probe", "--input", str(export), "--model", str(target), "--device", "cpu", "--config", str(config)]
        assert main([*argv, "--out", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    correct, moved = reports["correct"], reports["late"]
    assert correct["verdict"] == "pass" and "export check passed" in correct["verdict_rule"], correct["verdict_rule"]
    assert len(correct["seed_runs"]) == 2 and correct["data_quality"]["spread"] is not None
    assert moved["verdict"] == "fail" and "export check failed" in moved["verdict_rule"], moved["verdict_rule"]
    assert "position" in moved["alignment"]["rule"]


def test_an_export_that_fails_its_own_check_leaves_nothing_that_looks_complete(chain, tiny_model_dir, tmp_path, capsys):
    """The export checks itself before it reports success: checked against another target (the
    tiny model with its final norm of weight 1: the wrong norm for these states), it exits 1 naming
    sample and position, and its folder is moved to OUT.check-failed."""
    _target, _exports, shards = chain
    out = tmp_path / "spec"
    argv = ["export-speculators", "--input", str(shards["bf16"]), "--out", str(out), "--model", str(tiny_model_dir)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "sample 's" in err and "position" in err and "check-failed" in err, err
    assert not out.exists() and (tmp_path / "spec.check-failed" / "export_info.json").exists()
    assert main([*argv, "--no-check"]) == 0 and "not checked (--no-check)" in capsys.readouterr().out
