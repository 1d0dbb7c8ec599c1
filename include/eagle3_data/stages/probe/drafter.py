"""The drafter's verdict: a short EAGLE-3 training probe on a run's speculators export.

Every other check is a proxy; what the user buys is a drafter's acceptance length. The probe trains
a small draft head with speculators' own model, collation and loss (`speculators_probe.py`, run in
the speculators venv through a subprocess, so this package imports without it) on a fixed split of
the export, evaluates it on the held-out rows, and reports what the anchors judge drafters by:
per-position accuracy acc_0..acc_{k-1} (speculators' `cond_acc_k`: right at step k given right
before), `full_acc_k` (right at every step up to k), the simulated acceptance length
sum_k prod_{i<=k} acc_i (TorchSpec's trainer, NeMo's `tau_sim`; tokens accepted per verification
step, the bonus token not counted), the draft vocabulary's coverage of the held-out trained tokens
and the learning curve. The held-out rows may come from another export (`eval_export`): the
fault benchmark trains on broken data and scores on the target's own states, as serving does.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eagle3_data.errors import UserError
from eagle3_data.speculators_venv import PYTHON_ENV as PYTHON_ENV  # the probe's API
from eagle3_data.speculators_venv import speculators_python as speculators_python

if TYPE_CHECKING:
    from eagle3_data.config import ProbeConfig
    from eagle3_data.exports.check import LocalShards, StageShards

SCRIPT = Path(__file__).with_name("speculators_probe.py")
OVER_BUDGET_EXIT = 3  # speculators_probe.py's exit status when its projection is past the budget


class OverBudget(UserError):
    """The probe's first steps project past its budget (`probe.budget_s`): stopped there, before the
    budget was spent (`projection`: speculators_probe.Budget's figures; None when it was killed at
    the budget instead). A UserError: the config's sizes, not the weather, decide it."""

    def __init__(self, message: str, projection: dict[str, Any] | None = None):
        super().__init__(message)
        self.projection = projection


def default_device() -> str:
    """cuda where the worker has a GPU (the DAG's GPU queue), else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Arm:
    """One drafter: trained on `train_rows` of `train`, scored on `eval_rows` of `eval`, with the
    draft vocabulary of `vocab_dir` (d2t-N.npy, t2d-N.npy)."""

    name: str
    train: Path
    eval: Path
    train_rows: list[int]
    eval_rows: list[int]
    vocab_dir: Path
    seed: int = 0


def split(rows: int, samples: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """A fixed split of an export's rows: the held-out rows first, then up to `samples` train rows,
    from one permutation of (seed): the same export and seed always give the same split."""
    if rows < 2:
        raise UserError(f"probe: the export has {rows} sample(s); it needs at least 2 (train and held-out)")
    order = np.random.default_rng(seed).permutation(rows).tolist()
    held = min(eval_samples, max(1, rows // 5))
    return sorted(order[held : held + samples]), sorted(order[:held])


def draft_vocab_size(vocab_dir: Path) -> int:
    """N of the one d2t-N.npy in `vocab_dir` (the merge's draft vocabulary beside the export)."""
    found = sorted(vocab_dir.glob("d2t-*.npy"))
    if len(found) != 1:
        raise UserError(
            f"probe: {vocab_dir} holds {len(found)} d2t-N.npy files; expected the merge's one draft vocabulary"
        )
    return int(found[0].stem.split("-", 1)[1])


def train_and_score(
    verifier: Path,
    arms: list[Arm],
    config,
    *,
    device: str = "cpu",
    threads: int | None = None,
    budget_s: float | None = None,
) -> list[dict[str, Any]]:
    """Every arm in one speculators process; returns each arm's figures (`figures`). The process
    gets `budget_s` (default: the config's): past it, or when its first steps' pace projects past
    it (`speculators_probe.Budget`), OverBudget."""
    budget_s = config.budget_s if budget_s is None else budget_s
    spec = {
        "verifier": str(verifier),
        "device": device,
        "threads": threads,
        "budget_s": budget_s,
        "arms": [
            {
                "name": a.name,
                "train": str(a.train),
                "eval": str(a.eval),
                "train_rows": a.train_rows,
                "eval_rows": a.eval_rows,
                "vocab_dir": str(a.vocab_dir),
                "draft_vocab": draft_vocab_size(a.vocab_dir),
                "steps": config.steps,
                "draft_length": config.draft_length,
                "seed": a.seed,
                "batch_size": config.batch_size,
                "max_len": config.max_len,
                "lr": config.lr,
                "eval_every": config.eval_every,
            }
            for a in arms
        ],
    }
    with tempfile.TemporaryDirectory(prefix="eagle3-probe-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps({**spec, "deadline": time.time() + budget_s}))
        try:
            done = subprocess.run(
                [speculators_python(), str(SCRIPT), str(path)], capture_output=True, text=True, timeout=budget_s
            )
        except subprocess.TimeoutExpired:
            raise OverBudget(
                f"probe: stopped at its budget of {budget_s:.0f} s on {device} (probe.budget_s), before it finished"
            ) from None
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == OVER_BUDGET_EXIT and lines and "over_budget" in lines[-1]:
        raise OverBudget(over_budget_message(lines[-1]["over_budget"], device), lines[-1]["over_budget"])
    if done.returncode != 0:
        raise RuntimeError(f"probe: speculators failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return [figures(raw) for raw in lines]


def over_budget_message(projection: dict[str, Any], device: str) -> str:
    """One line: what the first steps measured, what they project, what to change."""
    return (
        f"probe: {projection.get('drafters', 1)} drafters, {projection['steps']} steps in all, would take "
        f"~{projection['projected_s']:.0f} s on {device} "
        f"({projection['step_s']:.2f} s a step over steps 2-{1 + projection['timed_steps']}, "
        f"{projection['eval_s']:.1f} s an evaluation), past probe.budget_s {projection['budget_s']:.0f}: "
        "stopped after its first steps; lower probe.steps, max_len or eval_samples, or run it on a GPU worker"
    )


def _ratios(sums: list[float], totals: list[float]) -> list[float]:
    return [s / t if t else 0.0 for s, t in zip(sums, totals)]


def simulated_acceptance(acc: list[float]) -> float:
    """sum_k prod_{i<=k} acc_i: the expected tokens accepted per verification step when step k is
    right with probability acc_k given steps before it were right (bonus token not counted)."""
    return float(np.sum(np.cumprod(acc))) if acc else 0.0


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    """One arm's verdict from the metrics' sums: acc_k, full_acc_k, the simulated acceptance length
    and the held-out loss at the last evaluation, and the learning curve (loss per step, acceptance
    and held-out loss per evaluation). The held-out loss (speculators' own KL to the target's
    distribution, on rows the head never trained on) is the finer figure: acc_k count only argmax
    hits, and on the CPU-sized probe a broken export moves the loss well beyond its seed spread
    where the argmax hits stay within it (benchmarks/probe_faults.py). `first_draft`: the
    same for each held-out answer's first draft alone (the draft right after prefill, on every
    request; the position a loss mask one position late never trains)."""
    curve = [
        {
            "step": c["step"],
            "simulated_acceptance": simulated_acceptance(_ratios(c["cond_acc_sum"], c["cond_acc_total"])),
            "eval_loss": c["loss"],
        }
        for c in raw["curve"]
    ]
    last = raw["curve"][-1]
    acc = _ratios(last["cond_acc_sum"], last["cond_acc_total"])
    return {
        "name": raw["name"],
        "acc": acc,
        "full_acc": _ratios(last["full_acc_sum"], last["full_acc_total"]),
        "simulated_acceptance": simulated_acceptance(acc),
        "eval_tokens": int(last["full_acc_total"][0]),
        "losses": raw["losses"],
        "eval_loss": last["loss"],
        "first_draft": {
            "acc": last["first_hits"] / last["first_total"] if last["first_total"] else 0.0,
            "eval_loss": last["first_loss"],
            "positions": int(last["first_total"]),
        },
        "curve": curve,
        "seconds": raw["seconds"],
    }


def coverage(export: Path, rows: list[int], vocab_dir: Path) -> float:
    """The share of the rows' trained tokens (loss_mask 1) inside the draft vocabulary: what the
    drafter can predict at all."""
    import datasets

    t2d = np.load(vocab_dir / f"t2d-{draft_vocab_size(vocab_dir)}.npy")
    table = datasets.load_from_disk(str(export)).with_format("numpy").select(rows)
    inside = total = 0
    for row in table:
        ids = np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]).astype(bool)]
        inside += int(t2d[ids[ids < t2d.shape[0]]].sum())
        total += int(ids.size)
    return inside / total if total else 0.0


FIT_OFFSETS = (-1, 0, 1)


def last_state_fit(export: Path, rows: list[int], verifier: Path, *, device: str = "cpu") -> dict[str, Any]:
    """How well the export's own last states predict its trained ids, before any training: over
    the rows' trained tokens (loss mask 1), the mean log-probability of each id under the target's
    final norm and LM head applied to the stored last state before it (`mean_logprob`, nats), and
    the share of those ids that are the argmax there (`top1`). The target's own generations sit
    near their sampling's entropy (the tiny target's answers at temperature 0.5: top1 0.81); states
    joined to another sample's ids predict almost none (0.02), a fault a short training run does
    not tell beyond its seed spread even at a GPU's size (benchmarks/probe_faults.py). The same
    numbers the extraction proved each local answer with (target_head.verify), read back from
    the export as the trainer reads it: what went wrong after the extraction shows here.
    `by_offset`: the same mean with each state paired with the token `d` positions after the one
    it is stored beside (d = -1, 0, +1): an export whose states sit beside the tokens they predict
    fits best at 0 (`alignment`)."""
    import datasets
    import torch
    from safetensors.torch import load_file

    from eagle3_data.target_head.final_norm import final_norm_eps, final_norm_weight
    from eagle3_data.target_head.logprobs import LogprobHead, lm_head_weight

    dtype = "bfloat16" if device == "cuda" else "float32"  # LogprobHead: the engine's head product on a GPU
    head = LogprobHead(
        (final_norm_weight(verifier), final_norm_eps(verifier)),
        lm_head_weight(verifier),
        device=device,
        compute_dtype=dtype,
    )
    masks = datasets.load_from_disk(str(export)).with_format("numpy").select(rows)["loss_mask"]
    total, hits, tokens, paired_tokens = 0.0, 0, 0, 0
    offset_sums = {d: 0.0 for d in FIT_OFFSETS}
    for row, mask in zip(rows, masks):
        stored = load_file(str(export / "hidden_states" / f"hs_{row}.safetensors"))
        states = stored["hidden_states"].float()
        if "hidden_states_scales" in stored:  # the fp8 export: one scale per token
            states = states * stored["hidden_states_scales"]
        ids = stored["token_ids"]
        logprobs, top1 = head.token_logprobs_and_top1(states[:, -1], ids)
        trained = torch.as_tensor(np.asarray(mask), dtype=torch.bool) & ~torch.isnan(logprobs)
        total += float(logprobs[trained].double().sum())
        hits += int(top1[trained].sum())
        tokens += int(trained.sum())
        paired = trained.clone()  # the offsets compare on the positions every one of them can pair
        paired[:2] = False
        paired[-1:] = False
        paired_tokens += int(paired.sum())
        for d in FIT_OFFSETS:
            shifted = ids if d == 0 else torch.roll(ids, -d)  # position i scored against ids[i + d]
            lp = logprobs if d == 0 else head.token_logprobs(states[:, -1], shifted)[0]
            offset_sums[d] += float(lp[paired].double().sum())
    by_offset = {str(d): offset_sums[d] / paired_tokens if paired_tokens else None for d in FIT_OFFSETS}
    return {
        "mean_logprob": total / tokens if tokens else None,
        "top1": hits / tokens if tokens else None,
        "tokens": tokens,
        "by_offset": by_offset,
    }


def alignment(fit: dict[str, Any], export_check: dict[str, Any] | None) -> dict[str, Any]:
    """The deterministic half of the verdict. The export check (each state against the
    log-probability the extraction recorded for its token, read through the trainer's reader)
    decides when it ran. Without it the last-state fit can fail an export, never pass one: states
    that fit their neighbours' tokens better than their own sit beside the wrong tokens, but on
    repetitive text (the tiny target's answers) a state one position late can still fit best where
    it is (benchmarks/probe_faults.py), so a fit that looks right is inconclusive."""
    by = fit.get("by_offset") or {}
    margin = None if by.get("0") is None else by["0"] - max(by["-1"], by["1"])
    fit_rule = (
        "no trained tokens for the last-state fit"
        if margin is None
        else f"last-state fit {by['0']:.3f} nats at the stored pairing, {margin:+.3f} over one position off"
    )
    if export_check is not None:
        if export_check.get("verdict") != "pass":
            return {"verdict": "fail", "rule": f"export check failed: {export_check.get('error')}; {fit_rule}"}
        return {
            "verdict": "pass",
            "rule": f"export check passed on {export_check.get('rows_checked')} rows; {fit_rule}",
        }
    if margin is not None and margin < 0:
        return {"verdict": "fail", "rule": f"{fit_rule}: the states fit a neighbour's tokens better (misaligned)"}
    return {"verdict": "inconclusive", "rule": f"no export check (no extraction to check against); {fit_rule}"}


def data_quality(runs: list[dict[str, Any]], floor: float | None) -> dict[str, Any]:
    """The training half: the simulated acceptance of every seed (the same rows, another init and
    sample order), its mean and spread (max - min) on this run's own data. Against `floor`
    (probe.min_simulated_acceptance): pass when the mean is above it by more than the spread, fail
    when below it by more, else inconclusive (within the spread: no difference); with one seed, no
    spread is measured and the verdict is inconclusive; without a floor, not judged."""
    values = [r["simulated_acceptance"] for r in runs]
    mean = float(np.mean(values)) if values else None
    spread = float(max(values) - min(values)) if len(values) > 1 else None
    out = {"seeds": [r["seed"] for r in runs], "simulated_acceptance": values, "mean": mean, "spread": spread}
    if floor is None:
        return {**out, "verdict": None, "rule": "not judged (no probe.min_simulated_acceptance)"}
    if spread is None:
        return {**out, "verdict": "inconclusive", "rule": "one seed: no spread measured (probe.seeds >= 2)"}
    if mean - floor > spread:
        verdict = "pass"
    elif floor - mean > spread:
        verdict = "fail"
    else:
        verdict = "inconclusive"
    rule = f"mean {mean:.3f} vs floor {floor:.3f}, seed spread {spread:.3f}" + (
        ": within the spread, no difference" if verdict == "inconclusive" else ""
    )
    return {**out, "verdict": verdict, "rule": rule}


def verdict(align: dict[str, Any], quality: dict[str, Any]) -> dict[str, Any]:
    """pass / fail / inconclusive and the rule that drew it: alignment decides first (deterministic);
    then data quality, where it was judged."""
    if align["verdict"] == "fail":
        v = "fail"
    elif align["verdict"] == "inconclusive" or quality["verdict"] == "inconclusive":
        v = "inconclusive"
    elif quality["verdict"] == "fail":
        v = "fail"
    else:
        v = "pass"
    return {
        "verdict": v,
        "rule": f"alignment {align['verdict']} ({align['rule']}); data quality "
        + (quality["verdict"] or "not judged")
        + f" ({quality['rule']})",
        "alignment": align,
        "data_quality": quality,
    }


@dataclass(frozen=True)
class ExportCheck:
    """The extraction an export came from, to check the export against through speculators'
    reader (exports.check.check_export) on `samples` rows (None: all; 0: not checked)."""

    shards: LocalShards | StageShards
    samples: int | None = 8


def probe_export(
    export: Path,
    verifier: Path,
    config: ProbeConfig,
    *,
    eval_export: Path | None = None,
    device: str = "cpu",
    budget_s: float | None = None,
    check: ExportCheck | None = None,
) -> dict:
    """The probe on one export (draft vocabulary beside it): the artifact's JSON.
    `budget_s`: the training's share of the budget (default: the config's whole). One drafter per
    seed of `config.seeds` (the same split; another init and sample order), so the simulated
    acceptance comes with its spread on this data. `check`: with it the export is checked against
    the extraction it came from (`ExportCheck`). The JSON's `verdict` (pass / fail / inconclusive)
    and `verdict_rule`: `verdict`, from `alignment` and `data_quality`."""
    info = export / "export_info.json"
    if not info.exists():
        raise UserError(f"probe: {export} is no speculators export (no export_info.json; run export-speculators)")
    rows = json.loads(info.read_text())["samples"]
    train_rows, eval_rows = split(rows, config.samples, config.eval_samples, config.seed)
    vocab = export
    seeds = [config.seed + i for i in range(max(1, config.seeds))]
    arms = [Arm(f"seed{s}", export, eval_export or export, train_rows, eval_rows, vocab, s) for s in seeds]
    results = train_and_score(verifier, arms, config, device=device, budget_s=budget_s)
    result = results[0]
    runs = [
        {"seed": s, "simulated_acceptance": r["simulated_acceptance"], "eval_loss": r["eval_loss"], "acc": r["acc"]}
        for s, r in zip(seeds, results)
    ]
    result.pop("name")
    fit = last_state_fit(export, train_rows, verifier, device=device)
    export_check = None
    if check is not None and check.samples != 0:  # 0: export.check_samples off
        from eagle3_data.exports.check import ExportCheckFailed, check_export

        try:
            export_check = check_export(export, verifier, check.shards, samples=check.samples, device=device)
        except ExportCheckFailed as exc:
            export_check = {"verdict": "fail", "error": str(exc)}
    judged = verdict(alignment(fit, export_check), data_quality(runs, config.min_simulated_acceptance))
    return {
        "verdict": judged["verdict"],
        "verdict_rule": judged["rule"],
        "config": config.model_dump(),
        "export_samples": rows,
        "train_samples": len(train_rows),
        "eval_samples": len(eval_rows),
        "draft_vocab_size": draft_vocab_size(vocab),
        "coverage": coverage(eval_export or export, eval_rows, vocab),
        "last_state_fit": fit,
        "export_check": export_check,
        "alignment": judged["alignment"],
        "data_quality": judged["data_quality"],
        "seed_runs": runs,
        **result,
    }
