"""The probe tells good data from broken data: on the tiny target (CPU), drafters trained with
speculators on the correct export (over several seeds: the run-to-run spread) and on the same
rows with each fault of eagle3_data.dev.probe_data injected, all scored on the same held-out rows
of the correct export (the target's own states, as serving sees them).

    .venv/bin/python benchmarks/probe_faults.py                 # the RESULTS.md figures
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
    """The correct data once per seed, each fault once (seed 0), the same split and held-out rows."""
    from eagle3_data.probe import Arm, split

    train_rows, eval_rows = split(samples, config.samples, config.eval_samples, 0)
    out = [Arm(f"correct/seed{s}", correct, correct, train_rows, eval_rows, correct, s) for s in range(seeds)]
    out += [Arm(f, path, correct, train_rows, eval_rows, correct, 0) for f, path in faulty.items()]
    return out


def probe_config(**overrides):
    from eagle3_data.config import ProbeConfig

    return ProbeConfig(
        **{
            "samples": 1024,
            "eval_samples": 16,
            "steps": 40,
            "draft_length": 3,
            "batch_size": 4,
            "max_len": 512,
            "lr": 3e-3,
            "eval_every": 10,
            **overrides,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the least contention on a shared machine)")
    p.add_argument(
        "--smoke", action="store_true", help="make test's size: 16 samples, 4 steps, 2 seeds (checks the script)"
    )
    args = p.parse_args()
    if args.smoke:
        args.samples, args.steps, args.seeds = 16, 4, 2
    import torch

    from eagle3_data.dev.probe_data import calibration
    from eagle3_data.probe import train_and_score

    torch.set_num_threads(args.threads)

    config = probe_config(steps=args.steps, eval_samples=max(8, args.samples // 5))
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        target, correct, faulty = calibration(tiny_target(), Path(tmp), args.samples)
        results = train_and_score(
            target, arms(correct, faulty, args.samples, args.seeds, config), config, threads=args.threads
        )
    print(f"{'arm':<20} {'sim. acceptance':>15}  acc_k")
    for r in results:
        print(f"{r['name']:<20} {r['simulated_acceptance']:>15.3f}  {' '.join(f'{a:.3f}' for a in r['acc'])}")
    good = [r["simulated_acceptance"] for r in results if r["name"].startswith("correct/")]
    bad = {r["name"]: r["simulated_acceptance"] for r in results if not r["name"].startswith("correct/")}
    spread = max(good) - min(good)
    print(
        f"correct: min {min(good):.3f} max {max(good):.3f} spread {spread:.3f}; "
        + "; ".join(f"{k} {min(good) - v:+.3f} below" for k, v in bad.items())
    )
    worst = max(bad.values())
    ratio = f"{worst / min(good):.3f}" if min(good) > 0 else "n/a (a correct seed scored 0)"
    print(f"RATIO probe_faults {ratio} (the best fault's acceptance / the correct data's lowest seed)")


if __name__ == "__main__":
    main()
