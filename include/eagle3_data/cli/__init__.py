"""`eagle3-data`: every stage runnable without Airflow.

Each command group lives in its own module with a `register(subparsers)` function; heavy
imports (torch, transformers, pyarrow) happen inside the command, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eagle3_data.errors import UserError

# each module has a `register(subparsers)`; a stage's command lives in its package (stages/X/cli.py)
COMMAND_MODULES = [
    "eagle3_data.stages.audit.cli",
    "eagle3_data.stages.reconstruct.cli",
    "eagle3_data.stages.policy.cli",
    "eagle3_data.stages.validate.cli",
    "eagle3_data.stages.generate.cli",
    "eagle3_data.stages.merge.cli",
    "eagle3_data.stages.hidden_states.cli",
    "eagle3_data.stages.probe.cli",
    "eagle3_data.cli.check_export",
    "eagle3_data.cli.report",
    "eagle3_data.stages.publish.cli",
    "eagle3_data.cli.plan",
    "eagle3_data.cli.config",
    "eagle3_data.cli.stage",
    "eagle3_data.cli.s3",
    "eagle3_data.stages.prompts.cli",
    "eagle3_data.cli.dev",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-data",
        description=__doc__.splitlines()[0],
        epilog="--debug (anywhere): show the traceback of an error; --json (anywhere): a stage command's full "
        "record as JSON instead of its summary (the default when stdout is not a terminal), the plan as JSON",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _known_error(exc: BaseException) -> str | None:
    """A one-line message for failures that are about the user's data or environment, not a bug:
    unreadable files, unreachable or refusing S3, malformed JSON/Parquet. None for anything else."""
    import json

    import pyarrow as pa
    from botocore.exceptions import BotoCoreError, ClientError

    from eagle3_data.storage.client import describe_client_error

    if isinstance(exc, ClientError):
        return describe_client_error(exc)
    if isinstance(exc, BotoCoreError):
        return f"S3: {exc}"
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc)
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text: {exc.reason} at byte {exc.start}"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
    if isinstance(exc, (pa.ArrowException, OSError)):
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input, a missing bucket or an unreachable service end in ONE line on
    stderr and exit 2 (1 for a failed gate); `--debug` (anywhere on the line, or EAGLE3_DEBUG=1)
    adds the traceback. Anything else is a bug and keeps its traceback."""
    import os
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("EAGLE3_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    from eagle3_data.cli import runs

    runs.JSON_OUTPUT = "--json" in argv  # per call: a stage's full record instead of its summary
    argv = [a for a in argv if a != "--json"]
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("eagle3-data: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = str(exc) if isinstance(exc, UserError) else _known_error(exc)
        if message is None:
            raise
        if debug:
            traceback.print_exc()
        if not isinstance(exc, UserError):
            message = " ".join(message.split())[:2000] + " (--debug shows the traceback)"
        print(f"eagle3-data: error: {message}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
