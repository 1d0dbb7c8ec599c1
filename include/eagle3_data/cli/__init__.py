"""`eagle3-data`: every stage runnable without Airflow.

Each command group lives in its own module with a `register(subparsers)` function; heavy
imports (torch, transformers, pyarrow) happen inside the command, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eagle3_data.errors import UserError

COMMAND_MODULES = [
    "tokenizer",
    "reconstruct",
    "validate",
    "generate",
    "merge",
    "extract",
    "report",
    "dev",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-data", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"eagle3_data.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"eagle3-data: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
