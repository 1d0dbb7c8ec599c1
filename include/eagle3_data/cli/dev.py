"""`eagle3-data dev ...`: offline stand-ins and builders for a laptop or CI."""

from __future__ import annotations

import argparse
import importlib

DEV_COMMAND_MODULES = ["dev_tokenizer", "dev_model", "dev_s3", "dev_serve"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = subparsers.add_parser("dev", help="offline builders and embedded services")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True)
    for name in DEV_COMMAND_MODULES:
        importlib.import_module(f"eagle3_data.cli.{name}").register(dev_sub)
