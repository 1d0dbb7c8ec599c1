"""The seeds' question, measured on the tiny target (CPU): does a drafter trained on ids that
disagree with the engine's by BPE re-splits accept less? The same generations (the target's own
sampled answers), trained on as sampled (the engine's exact ids) and with a share of their
answer tokens re-split (one token as two of the same text: what a canonical re-encoding does
where the engine sampled another split), the states extracted for each; every drafter scored on
the same held-out rows of the exact ids (the target's own generations, as serving sees them).

    .venv/bin/python benchmarks/probe_resplit.py                # the RESULTS.md figures
    .venv/bin/python benchmarks/probe_resplit.py --smoke        # make test's size

Prints one row per rate (simulated acceptance over seeds) and `RATIO probe_resplit <30% re-split
acceptance / exact ids' acceptance>` (means over seeds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))
sys.path.insert(0, str(HERE))

RATES = (0.0, 0.005, 0.065, 0.30)  # 6.5%: the seeds' figure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--prompt-pool",
        type=int,
        default=32,
        help="draw the prompts' tokens from this many tokens (0: from all; see probe_faults.py)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="make test's size: 16 samples, 4 steps, 1 seed (checks the script)"
    )
    args = p.parse_args()
    if args.smoke:
        args.samples, args.steps, args.seeds = 16, 4, 1
    import torch
    from probe_faults import probe_config, tiny_target
    from transformers import AutoTokenizer

    from eagle3_data.dev import probe_data
    from eagle3_data.stages.probe.drafter import Arm, split, train_and_score

    torch.set_num_threads(args.threads)
    # re-split rows are longer (up to ~1.3x at 30%): 512 packs 4 of them uncut
    config = probe_config(steps=args.steps, eval_samples=max(8, args.samples // 5), max_len=512)
    train_rows, eval_rows = split(args.samples, config.samples, config.eval_samples, 0)
    with tempfile.TemporaryDirectory(prefix="bench-resplit-") as tmp:
        work = Path(tmp)
        target = probe_data.with_trained_norm(tiny_target(), work / "target")
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        rows = probe_data.own_generations(target, args.samples, prompt_pool=args.prompt_pool or None)
        exact = probe_data.export_rows(target, rows, work / "exact")
        arms, achieved = [], {}
        for rate in RATES:
            export = exact
            if rate:
                resplit, achieved[rate] = probe_data.resplit(rows, rate, tokenizer, seed=1)
                export = probe_data.export_rows(target, resplit, work / f"resplit-{rate}")
            else:
                achieved[rate] = 0.0
            # every arm drafts over the exact ids' vocabulary: the eval labels are the target's argmax over
            # the draft vocabulary, so an arm with its own vocabulary is scored against other labels
            # the export orders rows by length, and re-split rows are longer: the same samples by sample_id
            same = probe_data.rows_of(export, probe_data.sample_ids(exact, train_rows))
            arms += [Arm(f"{rate}/{s}", export, exact, same, eval_rows, exact, s) for s in range(args.seeds)]
        results = train_and_score(target, arms, config, threads=args.threads)
    by_rate = {rate: [r["simulated_acceptance"] for r in results if r["name"].startswith(f"{rate}/")] for rate in RATES}
    print(f"{'re-split rate (asked)':>22} {'achieved':>9} {'sim. acceptance mean':>21} {'min':>6} {'max':>6}")
    for rate, values in by_rate.items():
        print(f"{rate:>22.1%} {achieved[rate]:>9.2%} {np.mean(values):>21.3f} {min(values):>6.3f} {max(values):>6.3f}")
    print(
        f"RATIO probe_resplit {np.mean(by_rate[0.30]) / np.mean(by_rate[0.0]):.3f} "
        "(30% re-split's simulated acceptance / the exact ids')"
    )


if __name__ == "__main__":
    main()
