"""The probe tells good data from broken data: on the tiny target (CPU), drafters trained with
speculators on the correct export (over several seeds: the run-to-run spread) and on the same
rows with each fault of eagle3_data.dev.probe_data injected, all scored on the same held-out rows
of the correct export (the target's own states, as serving sees them).

    .venv/bin/python benchmarks/probe_faults.py                 # the RESULTS.md figures
    .venv/bin/python benchmarks/probe_faults.py --smoke         # make test's size

Prints each train export's last state fit (no training: how its stored last states predict its
trained ids), one row per arm (held-out loss, the first drafts' loss and accuracy, simulated
acceptance, acc_k / full_acc_k), each figure's margins per fault, and `RATIO probe_faults <faults
told apart by a held-out loss>/<faults>; ...; <by the fit>; <by either>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))


def tiny_target() -> Path:
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.builds.sources import TINY_MODEL_ARGS
    from eagle3_data.builds.tiny_model import cached_tiny_model

    cache = REPO / ".cache"
    return cached_tiny_model(cached_kimi_tokenizer(cache), cache, **TINY_MODEL_ARGS)


def verdict(results: list[dict], figure: str, higher_is_better: bool) -> tuple[dict[str, list[float]], float, dict]:
    """({arm: `figure` per seed}, the correct data's seed spread, {fault: margin}): the margin is how
    far the fault's best seed falls short of the correct data's worst seed (positive: every seed of
    the fault scores worse than every seed of the correct data); a fault is told apart when its
    margin exceeds the spread."""
    by_arm: dict[str, list[float]] = {}
    for r in results:
        by_arm.setdefault(r["name"].split("/")[0], []).append(r[figure])
    good = by_arm["correct"]
    margins = {
        name: (min(good) - max(v)) if higher_is_better else (min(v) - max(good))
        for name, v in by_arm.items()
        if name != "correct"
    }
    return by_arm, max(good) - min(good), margins


def probe_config(**overrides):
    from eagle3_data.config import ProbeConfig

    return ProbeConfig(
        **{
            "samples": 1024,
            "eval_samples": 16,
            "steps": 40,
            "draft_length": 3,
            "batch_size": 4,
            "max_len": 256,  # 4 rows of 64 tokens, less one each (shift_batch): padding costs as much as data
            "lr": 3e-3,
            "eval_every": 50,
            **overrides,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=80)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--prompt-pool",
        type=int,
        default=32,
        help="draw the prompts' tokens from this many tokens (0: from all): rows that share tokens, as real "
        "text does; with every row on its own random tokens a head generalises to no held-out row",
    )
    p.add_argument(
        "--target",
        choices=("context", "token"),
        default="context",
        help="context: the tiny target with a previous-token head (its next token depends on the token "
        "before, which only the aux states carry); token: the random tiny target (next token ~80%% fixed "
        "by the current one)",
    )
    p.add_argument("--draft-vocab", type=int, default=1024, help="the draft vocabulary's size")
    p.add_argument(
        "--lr", type=float, default=1e-3, help="AdamW learning rate (3e-3 diverged at 200 steps on one seed in three)"
    )
    p.add_argument(
        "--device", default="cpu", help="where the states are extracted and the heads trained (cuda: a lent GPU)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the least contention on a shared machine)")
    p.add_argument(
        "--smoke", action="store_true", help="make test's size: 16 samples, 4 steps, 1 seed (checks the script)"
    )
    args = p.parse_args()
    if args.smoke:
        args.samples, args.steps, args.seeds = 16, 4, 1
    import torch

    from eagle3_data.dev.probe_data import FIT_SIGMAS, arms, calibration, top1_gap_in_standard_errors
    from eagle3_data.stages.probe.drafter import last_state_fit, split, train_and_score

    torch.set_num_threads(args.threads)

    config = probe_config(steps=args.steps, lr=args.lr, eval_samples=max(8, args.samples // 5))
    train_rows, eval_rows = split(args.samples, config.samples, config.eval_samples, 0)
    unused = sorted(set(range(args.samples)) - set(train_rows) - set(eval_rows))
    groups = [g for g in (train_rows, eval_rows, unused) if g]
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        target, correct, faulty = calibration(
            tiny_target(),
            Path(tmp),
            args.samples,
            prompt_pool=args.prompt_pool or None,
            groups=groups,
            context=args.target == "context",
            vocab_size=args.draft_vocab,
            device=args.device,
        )
        fits = {
            name: last_state_fit(path, train_rows, target, device=args.device)
            for name, path in {"correct": correct, **faulty}.items()
        }
        results = train_and_score(
            target,
            arms(correct, faulty, train_rows, eval_rows, args.seeds),
            config,
            device=args.device,
            threads=args.threads,
        )
    print(f"{'train data':<28} {'last state fit: mean log-prob, top1':>36}  (no training; the same for every seed)")
    for name, fit in fits.items():
        print(f"{name:<28} {fit['mean_logprob']:>25.3f}, {fit['top1']:.3f}")
    # told apart without training: the trained ids' top1 share FIT_SIGMAS standard errors below the correct data's
    fit_told = {
        name
        for name, fit in fits.items()
        if name != "correct" and top1_gap_in_standard_errors(fits["correct"], fit) > FIT_SIGMAS
    }
    print(
        f"{'arm':<28} {'held-out loss':>13} {'first draft: loss, acc':>22} {'sim. acceptance':>15}  acc_k / full_acc_k"
    )
    for r in results:
        r["first_draft_loss"] = r["first_draft"]["eval_loss"]
        acc, full = " ".join(f"{a:.3f}" for a in r["acc"]), " ".join(f"{a:.3f}" for a in r["full_acc"])
        first = f"{r['first_draft_loss']:.3f}, {r['first_draft']['acc']:.3f}"
        print(f"{r['name']:<28} {r['eval_loss']:>13.3f} {first:>22} {r['simulated_acceptance']:>15.3f}  {acc} / {full}")
    told: set[str] = set()
    paired_worse: set[str] = set()
    figures = (("eval_loss", False), ("first_draft_loss", False), ("simulated_acceptance", True))
    for figure, higher_is_better in figures:
        by_arm, spread, margins = verdict(results, figure, higher_is_better)
        good = by_arm["correct"]
        print(f"{figure}: correct min {min(good):.3f} max {max(good):.3f} spread {spread:.3f}")
        for name, margin in margins.items():
            apart = margin > spread
            paired = [f - c for f, c in zip(by_arm[name], good)]  # same seed: same init and sample order
            worse = all(d > 0 for d in paired) if not higher_is_better else all(d < 0 for d in paired)
            if figure.endswith("loss"):
                told |= {name} if apart else set()
                paired_worse |= {name} if worse else set()
            print(
                f"  {name}: margin {margin:+.3f} ({'told apart' if apart else 'NOT told apart'}); "
                f"minus correct, per seed: {' '.join(f'{d:+.3f}' for d in paired)}"
                f"{' (worse at every seed)' if worse else ''}"
            )
    print(
        f"RATIO probe_faults {len(told)}/{len(margins)} faults beyond the seed spread by a held-out loss (all drafts "
        f"or the first draft): {', '.join(sorted(told)) or 'none'}; {len(paired_worse)}/{len(margins)} worse at "
        f"every seed, paired: {', '.join(sorted(paired_worse)) or 'none'}; {len(fit_told)}/{len(margins)} by the last "
        f"state's fit: {', '.join(sorted(fit_told)) or 'none'}; {len(told | fit_told)}/{len(margins)} by either"
        + ("" if args.seeds > 1 else " (one seed: the spread between seeds is 0, not measured; a check of the script)")
    )


if __name__ == "__main__":
    main()
