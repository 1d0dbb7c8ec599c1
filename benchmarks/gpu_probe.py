"""The probe's cost on one GPU at Kimi-K2.5's width: a random DeepSeek-V3 with H = 7168 and Kimi's
vocabulary (4 layers: the drafter's cost depends on the width and the vocabularies, not the
target's depth), random rows extracted with the transformers backend, exported for speculators
with a 32,000-token draft vocabulary, then `eagle3_data.stages.probe.drafter` on cuda (bf16 autocast). Prints
the probe's figures (meaningless on random ids: this measures time) and its seconds per 1,000
trained samples. Run through benchmarks/gpu_probe.sh.

    python benchmarks/gpu_probe.py [--hidden 7168 --samples 320 --steps 200]
    python benchmarks/gpu_probe.py --smoke      # tiny sizes, any device: checks the script itself

Its default sizes are the config's probe defaults (256 train and 64 held-out rows, 200 steps of at
most 4,096 packed tokens, an evaluation every 25). Where they pace past probe.budget_s (a CPU:
`--hidden 64` is the tiny target's width) the probe stops after its first steps and this prints
the projection instead (this script's CPU row in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "include"))
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=HERE.parent / ".cache" / "gpu-probe")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--samples", type=int, default=320, help="rows extracted: train + held-out")
    ap.add_argument("--median-tokens", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--draft-vocab", type=int, default=32_000)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.samples, args.median_tokens, args.steps, args.draft_vocab = 256, 10, 32, 2, 512
    import torch
    from gpu_extract import build_model, make_rows

    from eagle3_data.config import ProbeConfig
    from eagle3_data.dev.probe_data import export_rows
    from eagle3_data.stages.probe.drafter import OverBudget, default_device, probe_export

    model = build_model(args.cache / f"dsv3-h{args.hidden}", layers=4, hidden=args.hidden, experts=8)
    rows = make_rows(args.samples, 0, args.median_tokens, 4 * args.median_tokens)
    device = default_device()
    print(
        f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), H={args.hidden}, "
        f"{args.samples} rows, {sum(len(r['input_ids']) for r in rows):,} tokens"
    )
    config = ProbeConfig(
        samples=args.samples,
        eval_samples=max(2, args.samples // 5),
        steps=args.steps,
        eval_every=max(1, args.steps // 8),
        max_len=256 if args.smoke else 4096,
        seeds=1,  # one drafter: the cost per trained sample (the probe's default trains probe.seeds of them)
    )
    trained = config.steps * config.batch_size
    with tempfile.TemporaryDirectory(prefix="gpu-probe-") as tmp:
        t0 = time.perf_counter()
        export = export_rows(model, rows, Path(tmp) / "export", vocab_size=args.draft_vocab, device=device)
        t1 = time.perf_counter()
        try:
            report = probe_export(export, model, config, device=device)
        except OverBudget as exc:
            over = exc.projection or {}
            print(f"extract + export {t1 - t0:.1f} s; {exc}")
            print(
                f"RATIO gpu_probe {over.get('projected_s', float('nan')) / trained * 1000:.1f} s per 1,000 trained "
                f"samples projected on {device} ({over.get('step_s', float('nan')):.2f} s a step): past the "
                f"budget of {config.budget_s:.0f} s"
            )
            return
        t2 = time.perf_counter()
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "simulated_acceptance",
                    "acc",
                    "full_acc",
                    "coverage",
                    "train_samples",
                    "eval_samples",
                    "seconds",
                )
            }
        )
    )
    print(
        f"extract + export {t1 - t0:.1f} s; probe {t2 - t1:.1f} s (speculators' side {report['seconds']:.1f} s) for "
        f"{trained} trained samples (steps x batch) of median {args.median_tokens} tokens, <= {config.max_len} "
        "packed per step"
    )
    print(f"RATIO gpu_probe {report['seconds'] / trained * 1000:.1f} s per 1,000 trained samples")


if __name__ == "__main__":
    main()
