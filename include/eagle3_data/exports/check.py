"""Proof at the trainer's door: an export read back by its trainer's own code, each state checked
against the token it is paired with (`eagle3-data check-export`; every export runs it on a sample of
rows before it reports success).

The extraction records, for every token, the target's log-probability of that token given
everything before it (`target_logprobs`, computed from the compute-dtype state and proved against
the engine's own: target_head/verify.py). That number travels to the trainer's door: the state
a trainer pairs with a target token, put through the target's final norm (where the layout stores
the state before it: speculators) and the LM head, must give back that log-probability. A state
one position off, a batch-mate's state, a norm applied twice or not at all move it by nats.

What is read, and by whom: `trainer_reader.py` runs in the speculators venv (speculators' own
`ArrowDataset` and `shift_batch`; SpecForge's own `OfflineEagle3Dataset` and its trainer's
`padding` shift) and writes, per sampled row, the (state, target token, loss mask) pairs the loss
sees, the aux states the drafter reads, and which original position each came from (measured by
running the same code over position indices). This side then checks, per row, against the
extraction's shard for the same sample id:
1. tokens: each target token is the extraction's token at its position;
2. log-probabilities: on every pair the trainer's loss mask trains, |log p(token | state) -
   target_logprobs| within the export dtype's noise (`TOLERANCE`);
3. aux states: equal to the shard's (bf16 and an fp8 extraction: bit for bit, after the export's
   conversion; speculators' fp8 export: within its per-token e4m3 rounding, `FP8_AUX_RELATIVE`);
4. the loss mask: the trainer's mask equals the extraction's at the position it came from;
5. the draft vocabulary, as the trainer's loader reads it: d2t and t2d agree, and equal
   speculators' own builder over the merge's `token_freq.pt`.
The first failure ends the check: ExportCheckFailed (exit 1) naming the sample, the row and the
position. The LM head's logits are computed in chunks of `CHUNK_TOKENS` rows (a [256, V] fp32
buffer: 168 MB at Kimi's 163,840 ids).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_data.errors import UserError

EXPORT_INFO = "export_info.json"
READER = Path(__file__).with_name("trainer_reader.py")
LAYOUTS = ("speculators", "specforge")
# |log p(token | state as exported) - target_logprobs| allowed, nats, by the dtype of the state the
# trainer reads: per trained position (`TOLERANCE`) and as a sample's mean over them
# (`MEAN_TOLERANCE`). target_logprobs come from the compute-dtype state (fp32 on CPU); the export
# stores it rounded (bf16: 2^-9 relative per value; fp8 e4m3: 2^-4). Measured on the dev target
# (the tiny DeepSeek-V3 with a spread final norm, its own answers; docs/hidden_states.md, "The
# export's own check"): bf16 worst position 0.024, mean 0.004-0.006; speculators' fp8 worst 0.29,
# mean 0.066. A state one position off moves it by a nat or more on most positions.
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float8_e4m3fn": 1.0}
MEAN_TOLERANCE = {"float32": 2e-4, "bfloat16": 0.02, "float8_e4m3fn": 0.25}
FP8_AUX_RELATIVE = 0.08  # ||aux - ref|| / ||ref|| per token and layer for a per-token e4m3 export (measured <= 0.035)
DEFAULT_SAMPLES = 8


class ExportCheckFailed(UserError):
    """An export's check failed: the trainer would train on states that do not predict their tokens."""

    exit_code = 1


@dataclass
class Layout:
    """What an export folder is: its trainer's layout, its rows (index.jsonl) and how its states are stored."""

    layout: str
    folder: Path
    rows: list[dict[str, Any]]
    state_dtype: str  # of the last state the trainer reads
    fp8: bool = False
    source: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def stores_pre_norm(self) -> bool:
        return self.layout == "speculators"


def read_layout(folder: str | Path) -> Layout:
    folder = Path(folder)
    info_path = folder / EXPORT_INFO
    if not folder.is_dir():
        raise UserError(f"--input {folder}: no such export folder")
    if not info_path.is_file():
        raise UserError(
            f"--input {folder}: no {EXPORT_INFO} (written by export-speculators / export-specforge; "
            "an export without it is incomplete)"
        )
    try:
        info = json.loads(info_path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{info_path}: not JSON ({exc})") from None
    layout = info.get("layout") or ("speculators" if (folder / "hidden_states").is_dir() else None)
    if layout not in LAYOUTS:
        raise UserError(f"{info_path}: field layout is {layout!r}, expected one of {', '.join(LAYOUTS)}")
    index = folder / "index.jsonl"
    if not index.is_file():
        raise UserError(f"--input {folder}: no index.jsonl (row -> sample_id)")
    rows = []
    for n, line in enumerate(index.read_text().splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{index} line {n}: not JSON") from None
        if not isinstance(entry.get("sample_id"), str):
            raise UserError(f"{index} line {n}: field sample_id is missing")
        if layout == "specforge" and not isinstance(entry.get("file"), str):
            raise UserError(f"{index} line {n} (sample {entry['sample_id']!r}): field file is missing")
        rows.append(entry)
    if not rows:
        raise UserError(f"--input {folder}: index.jsonl lists no rows")
    hs = info.get("hidden_states") or {}
    fp8 = hs.get("encoding") == "fp8_e4m3fn_per_token"
    state_dtype = "float8_e4m3fn" if fp8 else str(hs.get("dtype") or "bfloat16")
    return Layout(layout, folder, rows, state_dtype, fp8, info.get("source"), info)


def choose_rows(n: int, samples: int | None) -> list[int]:
    """`samples` rows spread evenly over the export (the first and the last included); all with None."""
    if samples is None or samples >= n:
        return list(range(n))
    if samples < 1:
        raise UserError(f"--samples {samples}: expected at least 1")
    return sorted({round(x) for x in np.linspace(0, n - 1, samples)})


class LocalShards:
    """The extraction's shards in a folder (or given as paths): sample_id -> Sample, read lazily."""

    def __init__(self, paths):
        from eagle3_data.exports.shards import ShardReader

        self.readers = [ShardReader(p) for p in paths]
        if not self.readers:
            raise UserError("check-export: no extraction shards (.safetensors) to check against")
        self.where = {sid: r for r in self.readers for sid in r.sample_ids}

    def get(self, sample_id: str, shard: str | None = None):
        reader = self.where.get(sample_id)
        if reader is None:
            raise ExportCheckFailed(f"check-export: sample {sample_id!r} is in no extraction shard")
        return reader, reader.get(sample_id)


class StageShards:
    """An extraction stage in the store: each shard fetched on first need (by the name index.jsonl records)."""

    def __init__(self, store, ref, work: Path):
        self.store, self.ref, self.work = store, ref, work
        self.files = {f["name"]: f for f in store.read_manifest(ref)["files"] if f["name"].endswith(".safetensors")}
        self.local: LocalShards | None = None
        self.fetched: list[Path] = []

    def get(self, sample_id: str, shard: str | None = None):
        if self.local is not None and sample_id in self.local.where:
            return self.local.get(sample_id)
        names = [shard] if shard in self.files else list(self.files)
        for name in names:
            path = self.work / name
            if path in self.fetched:
                continue
            f = self.files[name]
            self.fetched.append(self.store.get_file(self.ref, name, path, sha256=f["sha256"]))
            self.local = LocalShards(self.fetched)
            if sample_id in self.local.where:
                return self.local.get(sample_id)
        raise ExportCheckFailed(f"check-export: sample {sample_id!r} is in no shard of {self.store.uri(self.ref)}")


def _fail(layout: Layout, row: int, sample_id: str, what: str) -> ExportCheckFailed:
    return ExportCheckFailed(f"check-export {layout.layout} {layout.folder}: sample {sample_id!r} (row {row}) {what}")


def run_reader(
    layout: Layout, rows: list[int], out: Path, *, vocab: dict[str, Any] | None, python: str | None = None
) -> dict[str, Any]:
    from eagle3_data.speculators_venv import speculators_python

    spec = {
        "layout": layout.layout,
        "export": str(layout.folder),
        "rows": rows,
        "fp8": layout.fp8,
        "files": {str(r): str(layout.folder / layout.rows[r]["file"]) for r in rows}
        if layout.layout == "specforge"
        else {},
        "out": str(out),
        "vocab": vocab,
    }
    path = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [python or speculators_python(), str(READER), str(path)], capture_output=True, text=True, timeout=3600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"check-export: the trainer's reader failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _vocab_spec(layout: Layout, vocab_size: int) -> dict[str, Any] | None:
    folder = layout.folder
    if layout.layout == "speculators":
        found = sorted(folder.glob("d2t-*.npy"))
    else:
        found = sorted(folder.glob("vocab_mapping-*.pt"))
    if not found:
        return None
    if len(found) > 1:
        raise UserError(
            f"--input {folder}: {len(found)} draft vocabularies ({', '.join(p.name for p in found)}); expected one"
        )
    n = int(found[0].stem.split("-", 1)[1])
    return {"dir": str(folder), "n": n, "vocab_size": vocab_size}


def check_export(
    folder: str | Path,
    model: str | Path,
    shards,
    *,
    samples: int | None = DEFAULT_SAMPLES,
    python: str | None = None,
    tolerance: float | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Check an export folder against the extraction's shards (`shards`: LocalShards or
    StageShards) with the target's final norm and LM head from `model`; returns the figures,
    raises ExportCheckFailed at the first failure."""
    from eagle3_data.target_head.final_norm import final_norm_eps, final_norm_weight
    from eagle3_data.target_head.logprobs import LogprobHead, lm_head_weight

    started = time.monotonic()
    layout = read_layout(folder)
    rows = choose_rows(len(layout.rows), samples)
    head_weight = lm_head_weight(model)
    vocab_size = int(head_weight.shape[0])
    tol = TOLERANCE.get(layout.state_dtype, TOLERANCE["bfloat16"]) if tolerance is None else tolerance
    with tempfile.TemporaryDirectory(prefix="eagle3-check-export-") as tmp:
        read_started = time.monotonic()
        got = run_reader(layout, rows, Path(tmp), vocab=_vocab_spec(layout, vocab_size), python=python)
        read_s = time.monotonic() - read_started
        for row in rows:
            if str(row) in got["unavailable"]:
                sid = layout.rows[row]["sample_id"]
                raise _fail(
                    layout, row, sid, f"position 0: the trainer's reader refused it: {got['unavailable'][str(row)]}"
                )
        norm = (final_norm_weight(model), final_norm_eps(model)) if layout.stores_pre_norm else None
        # the head in fp32 on `device` (default: cuda where there is one): 2 x V x H FLOP a position,
        # 2.35 GFLOP at Kimi-K2.5's width, ~12 positions/s on one CPU core (benchmarks/RESULTS.md, its row)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        head = LogprobHead(norm, head_weight, device=device)
        head.model_norm = (final_norm_weight(model), final_norm_eps(model))  # for shards without target_logprobs
        figures = {"positions": 0, "trained_positions": 0, "max_abs_diff": 0.0, "sum_abs_diff": 0.0, "aux_values": 0}
        scored_s = 0.0
        t2d = None
        if got.get("vocab") is not None:
            from safetensors.torch import load_file

            t2d = load_file(str(Path(tmp) / "t2d.safetensors"))["t2d"].bool()
        trained_in_vocab = trained_total = 0
        for row in rows:
            from safetensors.torch import load_file

            sid = layout.rows[row]["sample_id"]
            pairs = load_file(str(Path(tmp) / f"row_{row}.safetensors"))
            reader, ref = shards.get(sid, layout.rows[row].get("shard"))
            scored = time.monotonic()
            _check_row(layout, row, sid, pairs, reader, ref, head, tol, figures)
            scored_s += time.monotonic() - scored
            mask = pairs["mask"].bool()
            if t2d is not None:
                trained = pairs["target"][mask]
                trained_in_vocab += int(t2d[trained.clamp(max=t2d.numel() - 1)].sum())
                trained_total += int(trained.numel())
        vocab = got.get("vocab")
        if vocab is not None:
            _check_vocab(layout, vocab)
    trained = figures["trained_positions"]
    return {
        "verdict": "pass",
        "layout": layout.layout,
        "state_dtype": layout.state_dtype,
        "rows_checked": len(rows),
        "rows": len(layout.rows),
        "positions": figures["positions"],
        "trained_positions": trained,
        "logprob": {
            "tolerance": tol,
            "max_abs_diff": figures["max_abs_diff"],
            "mean_abs_diff": figures["sum_abs_diff"] / trained if trained else None,
        },
        "reference": figures.get("reference", "target_logprobs recorded at extraction"),
        "aux_values_compared": figures["aux_values"],
        "draft_vocab": None
        if vocab is None
        else {
            "size": vocab["size"],
            "equals_trainers_builder": vocab.get("equals_builder"),
            "coverage_of_checked_rows": trained_in_vocab / trained_total if trained_total else None,
        },
        "device": str(head.device),
        "seconds": {"reader": read_s, "scoring": scored_s, "total": time.monotonic() - started},
        "scored_tokens_per_s": trained / scored_s if scored_s else None,
    }


def _check_row(
    layout: Layout, row: int, sid: str, pairs: dict[str, Any], reader, ref, head, tol: float, figures: dict[str, Any]
) -> None:
    ids, ref_mask = ref.input_ids.long(), ref.loss_mask.long()
    T = int(ids.numel())
    target, target_pos = pairs["target"], pairs["target_pos"]
    if target_pos.numel() and (int(target_pos.max()) >= T or int(target_pos.min()) < 0):
        raise _fail(
            layout,
            row,
            sid,
            f"position {int(target_pos.max())}: the trainer reads {target_pos.numel() + 1} tokens, "
            f"the extraction holds {T}",
        )
    wrong = (ids[target_pos] != target).nonzero()
    if wrong.numel():
        k = int(wrong[0])
        raise _fail(
            layout,
            row,
            sid,
            f"position {int(target_pos[k])}: the trainer's target token is {int(target[k])}, the extraction's "
            f"{int(ids[target_pos[k]])}",
        )
    mask, mask_pos = pairs["mask"], pairs["mask_pos"]
    known = mask_pos >= 0  # -1: a value the trainer's code set itself (SpecForge zeroes the last)
    if (mask_pos[known] >= T).any():
        raise _fail(layout, row, sid, f"field loss_mask: {mask.numel()} entries for {T} tokens")
    differs = (known & (mask != ref_mask[mask_pos.clamp(min=0)])).nonzero()
    if differs.numel():
        k = int(differs[0])
        raise _fail(
            layout,
            row,
            sid,
            f"position {int(mask_pos[k])}: the trainer's loss mask is {int(mask[k])}, the extraction's "
            f"{int(ref_mask[mask_pos[k]])} (field loss_mask)",
        )
    recorded = ref.target_logprobs
    if recorded is None:  # a shard extracted without logprobs: the reference is its own stored last state
        if not reader.has_last:
            raise UserError(
                f"extraction shard {reader.path.name}: neither target_logprobs nor last_hidden_states to check against"
            )
        from eagle3_data.target_head.logprobs import LogprobHead

        norm = head.model_norm if reader.last_hidden_norm == "pre" else None
        own = LogprobHead(norm, head.head, device=head.device, chunk_tokens=head.chunk_tokens)
        recorded = own.token_logprobs(ref.last_hidden_states, ids)[0]
        figures["reference"] = "recomputed from the shard's own last state (no target_logprobs)"
    trained = mask.bool()
    figures["positions"] += int(target.numel())
    if trained.any():
        states = pairs["state"][trained]
        # LogprobHead scores ids[i] from state i-1: one dummy row at each end lines them up
        lp, _ = head.token_logprobs(torch.cat([states, states[:1]]), torch.cat([target[trained][:1], target[trained]]))
        got = lp[1:]
        want = recorded.float()[target_pos[trained]]
        diff = (got - want).abs()
        bad = (~(diff <= tol)).nonzero()
        mean_tol = tol * MEAN_TOLERANCE.get(layout.state_dtype, 0.2) / TOLERANCE.get(layout.state_dtype, 1.0)
        over = f"> {tol} for {layout.state_dtype}"
        if not bad.numel() and not float(diff.mean()) <= mean_tol:  # every position inside, the sample's mean not
            bad = diff.argmax().reshape(1, 1)
            over = f"the worst; the sample's mean {float(diff.mean()):.4f} > {mean_tol} for {layout.state_dtype}"
        if bad.numel():
            k = int(bad[0])
            pos = int(target_pos[trained][k])
            raise _fail(
                layout,
                row,
                sid,
                f"position {pos}: log p(token {int(target[trained][k])}) is {float(got[k]):.4f} from the state "
                f"{layout.layout} pairs with it, the extraction recorded {float(want[k]):.4f} "
                f"(|diff| {float(diff[k]):.4f} {over}; a state off by a position, "
                "another sample's, or the wrong side of the final norm)",
            )
        figures["trained_positions"] += int(trained.sum())
        figures["max_abs_diff"] = max(figures["max_abs_diff"], float(diff.max()))
        figures["sum_abs_diff"] += float(diff.double().sum())
    _check_aux(layout, row, sid, pairs, ref, figures)


def _check_aux(layout: Layout, row: int, sid: str, pairs: dict[str, Any], ref, figures: dict[str, Any]) -> None:
    aux, aux_pos = pairs["aux"], pairs["aux_pos"]
    T = int(ref.input_ids.numel())
    if aux_pos.numel() and (int(aux_pos.max()) >= T or int(aux_pos.min()) < 0):
        raise _fail(layout, row, sid, f"field aux states: position {int(aux_pos.max())} of {T} tokens")
    want = ref.aux_hidden_states[aux_pos]
    layers = 3
    got3 = aux.reshape(aux.shape[0], layers, -1)
    want3 = want.reshape(want.shape[0], layers, -1)
    if got3.shape != want3.shape:
        raise _fail(
            layout, row, sid, f"field aux states: shape {tuple(got3.shape)}, the extraction's {tuple(want3.shape)}"
        )
    if layout.fp8:
        err = (got3.float() - want3.float()).norm(dim=-1) / want3.float().norm(dim=-1).clamp(min=1e-30)
        bad = (~(err <= FP8_AUX_RELATIVE)).nonzero()
        detail = lambda t, layer: f"relative error {float(err[t, layer]):.3f} > {FP8_AUX_RELATIVE} (fp8)"  # noqa: E731
    else:
        bad = (got3.to(want3.dtype) != want3).any(dim=-1).nonzero()
        detail = lambda t, layer: "differs from the extraction's"  # noqa: E731
    if bad.numel():
        t, layer = int(bad[0][0]), int(bad[0][1])
        raise _fail(
            layout,
            row,
            sid,
            f"position {int(aux_pos[t])}: aux state {layer} (of {layers}) {detail(t, layer)} for the same sample id "
            "(layers in another order, states moved, or another sample's)",
        )
    figures["aux_values"] += int(got3.numel())


def _check_vocab(layout: Layout, vocab: dict[str, Any]) -> None:
    where = f"check-export {layout.layout} {layout.folder}: draft vocabulary"
    if not vocab["consistent"]:
        first = vocab.get("first_inconsistent") or {}
        raise ExportCheckFailed(
            f"{where}: d2t maps draft id {first.get('draft_id')} to target id {first.get('target_id')}, which t2d "
            "does not hold (d2t and t2d disagree: an offset off by one?)"
        )
    if vocab.get("equals_builder") is False:
        first = vocab.get("first_builder_difference") or {}
        raise ExportCheckFailed(
            f"{where}: draft id {first.get('draft_id')} maps to target id {first.get('target_id')}, the trainer's "
            f"own builder over token_freq.pt maps it to {first.get('builder_target_id')}"
        )
