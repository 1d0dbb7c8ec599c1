"""The probe tells good data from broken data: on the tiny target (CPU), drafters trained with
speculators on the correct export (over several seeds: the run-to-run spread) and on the same
rows with each fault of eagle3_data.dev.probe_data injected, all scored on the same held-out rows
of the correct export (the target's own states, as serving sees them).

    .venv/bin/python benchmarks/probe_faults.py --samples 64    # the RESULTS.md figures
    .venv/bin/python benchmarks/probe_faults.py --smoke         # make test's size

Prints one row per arm (simulated acceptance, acc_k) and `RATIO probe_faults <worst fault's
acceptance / the correct data's lowest seed>`.
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


def arms(correct: Path, faulty: dict[str, Path], samples: int, seeds: int, config):
    """The correct data and each fault over the same seeds, rows, held-out rows and draft vocabulary
    (the correct export's): an arm differs from the correct one by its injected fault alone, and
    every arm is scored against the trusted labels (the correct export's held-out rows)."""
    from eagle3_data.probe import Arm, split

    train_rows, eval_rows = split(samples, config.samples, config.eval_samples, 0)
    data = {"correct": correct, **faulty}
    return [
        Arm(f"{name}/seed{s}", path, correct, train_rows, eval_rows, correct, s)
        for name, path in data.items()
        for s in range(seeds)
    ]


def verdict(results: list[dict]) -> tuple[dict[str, list[float]], float, dict[str, float]]:
    """({arm: acceptance per seed}, the correct data's seed spread, {fault: the correct data's lowest
    seed minus the fault's highest}): a fault is told apart when its margin exceeds the spread."""
    by_arm: dict[str, list[float]] = {}
    for r in results:
        by_arm.setdefault(r["name"].split("/")[0], []).append(r["simulated_acceptance"])
    good = by_arm["correct"]
    margins = {name: min(good) - max(v) for name, v in by_arm.items() if name != "correct"}
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
            "eval_every": 10,
            **overrides,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--prompt-pool",
        type=int,
        default=32,
        help="draw the prompts' tokens from this many tokens (0: from all): rows that share tokens, as real "
        "text does; with every row on its own random tokens a head generalises to no held-out row",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the least contention on a shared machine)")
    p.add_argument(
        "--smoke", action="store_true", help="make test's size: 16 samples, 4 steps, 2 seeds (checks the script)"
    )
    args = p.parse_args()
    if args.smoke:
        args.samples, args.steps, args.seeds = 16, 4, 2
    import torch

    from eagle3_data.dev.probe_data import calibration
    from eagle3_data.probe import split, train_and_score

    torch.set_num_threads(args.threads)

    config = probe_config(steps=args.steps, eval_samples=max(8, args.samples // 5))
    train_rows, eval_rows = split(args.samples, config.samples, config.eval_samples, 0)
    unused = sorted(set(range(args.samples)) - set(train_rows) - set(eval_rows))
    groups = [g for g in (train_rows, eval_rows, unused) if g]
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        target, correct, faulty = calibration(
            tiny_target(), Path(tmp), args.samples, prompt_pool=args.prompt_pool or None, groups=groups
        )
        results = train_and_score(
            target, arms(correct, faulty, args.samples, args.seeds, config), config, threads=args.threads
        )
    print(f"{'arm':<28} {'sim. acceptance':>15}  acc_k / full_acc_k")
    for r in results:
        acc, full = " ".join(f"{a:.3f}" for a in r["acc"]), " ".join(f"{a:.3f}" for a in r["full_acc"])
        print(f"{r['name']:<28} {r['simulated_acceptance']:>15.3f}  {acc} / {full}")
    by_arm, spread, margins = verdict(results)
    good = by_arm["correct"]
    print(f"correct: min {min(good):.3f} max {max(good):.3f} spread {spread:.3f}")
    for name, margin in margins.items():
        told = "told apart" if margin > spread else "NOT told apart"
        paired = " ".join(f"{f - c:+.3f}" for f, c in zip(by_arm[name], good))  # same seed: same init and order
        print(f"{name}: max {max(by_arm[name]):.3f}, margin {margin:+.3f} ({told}); minus correct, per seed: {paired}")
    worst = max(max(v) for k, v in by_arm.items() if k != "correct")
    ratio = f"{worst / min(good):.3f}" if min(good) > 0 else "n/a (a correct seed scored 0)"
    print(f"RATIO probe_faults {ratio} (the best fault seed's acceptance / the correct data's lowest seed)")


if __name__ == "__main__":
    main()
