"""`eagle3-data dev build-tokenizer`."""

from __future__ import annotations

import argparse


def register(dev_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = dev_sub.add_parser("build-tokenizer", help="rebuild Kimi-K2.5's tokenizer offline from splintr-rs")
    p.add_argument("--out", required=True, help="directory to write (AutoTokenizer-loadable)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data.builds.kimi_tokenizer import build_kimi_tokenizer

    out = build_kimi_tokenizer(args.out)
    print(out)
    return 0
