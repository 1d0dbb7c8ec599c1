"""`eagle3-data config check [FILE]`: validate a pipeline config and print it resolved."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("config", help="pipeline config")
    sub = p.add_subparsers(dest="config_command", required=True)
    check = sub.add_parser(
        "check",
        help="validate a config (default: $EAGLE3_CONFIG, else the packaged one) and print it resolved",
        description="Exit 0 and print the resolved config (defaults filled, per-dataset thresholds "
        "inherited), or exit 2 with one line per bad key.",
    )
    check.add_argument(
        "file", nargs="?", default=None, help="pipeline YAML (default: $EAGLE3_CONFIG, else the packaged default)"
    )
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    import yaml

    from eagle3_data.config import config_path, load_config
    from eagle3_data.errors import UserError

    path = config_path(args.file)
    try:
        cfg = load_config(path)
    except UserError as exc:
        for line in str(exc).splitlines():
            print(f"eagle3-data: error: {line}", file=sys.stderr)
        return 2
    print(f"# {path}: valid")
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True))
    return 0
