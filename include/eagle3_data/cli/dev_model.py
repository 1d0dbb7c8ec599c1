"""`eagle3-data dev build-model`."""

from __future__ import annotations

import argparse


def register(dev_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = dev_sub.add_parser("build-model", help="build a tiny random DeepSeek-V3 with Kimi's vocabulary")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (eagle3-data dev build-tokenizer)")
    p.add_argument("--out", required=True, help="model directory to write (AutoModelForCausalLM-loadable)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same weights, byte for byte")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3_data.builds.tiny_model import build_tiny_model
    from eagle3_data.errors import UserError

    if not (Path(args.tokenizer) / "tokenizer.json").exists():
        raise UserError(f"--tokenizer {args.tokenizer}: no tokenizer.json there (run eagle3-data dev build-tokenizer)")
    if args.layers < 4 or args.hidden < 16 or args.hidden % 16:
        raise UserError(f"--layers {args.layers} --hidden {args.hidden}: need layers >= 4 and hidden a multiple of 16")
    print(build_tiny_model(args.tokenizer, args.out, seed=args.seed, layers=args.layers, hidden=args.hidden))
    return 0
