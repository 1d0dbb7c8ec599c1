"""`eagle3-data plan`: what a run would cost before anything is spent (no generation, no GPU).

The same plan as the DAG's `dry_run` (plan: each dataset's prompts loaded, rendered and
routed by `load_route`, the run's figures by `run_plan`): samples per side and routing strategy,
prompt tokens measured, output tokens and overflow USD expected and at most against
`generation.overflow.max_usd`, wall time by the source of its rates, hidden-state storage per
dtype, extraction GPU hours and the probe's time. A table by default, `--json` (cli.main) for the record.

Prompts: `--prompts DATASET=PATH` (a file, folder or s3:// URI; repeatable), else each configured
dataset's source (its date partition with `--date`, else the newest or undated one). Earlier runs
in the bucket give observed rates and answer lengths (never a stand-in's); `--offline` reads no
bucket and plans from the config alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from eagle3_data.cli.runs import add_config_arg, add_store_args, cli_run
from eagle3_data.errors import UserError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan",
        help="what a run would generate, cost, store and take (no spend, no GPU)",
        epilog="--json: the whole plan as JSON (what a dry run writes to runs/RUN_KEY/plan/all/plan.json)",
    )
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="DATASET=PATH",
        help="a dataset's prompts (file, folder or s3:// URI); repeat per dataset (default: the config's sources)",
    )
    p.add_argument("--dataset", action="append", default=[], help="plan only these datasets (repeatable)")
    p.add_argument("--date", help="the date partition YYYY-MM-DD a scheduled run of that date reads")
    p.add_argument("--run-key", default="plan", help="the run key the plan is for (earlier runs: every other key)")
    add_config_arg(p)
    p.add_argument("--bucket", help="S3 bucket (default: the config's storage.bucket)")
    p.add_argument("--prefix", help="S3 key prefix (default: the config's storage.prefix)")
    add_store_args(p)
    p.add_argument("--offline", action="store_true", help="read no bucket: rates and answer lengths from the config")
    p.set_defaults(func=_run)


class OfflineStore:
    """The store a plan without S3 reads: no earlier runs, nothing written, local prompt files only."""

    client = None
    bucket = prefix = "offline"

    def run_keys(self) -> list[str]:
        return []

    def uri(self, ref, name: str | None = None) -> str:
        return f"(offline) runs/{ref.run_key}/{ref.stage}/{ref.dataset}" + (f"/{name}" if name else "")


def _prompts(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--prompts {item!r}: expected DATASET=PATH (e.g. chat=prompts/chat.jsonl)")
        out[name] = path
    return out


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline
    from eagle3_data.cli import runs
    from eagle3_data.config import load_config
    from eagle3_data.plan import format_plan, run_plan
    from eagle3_data.storage.refs import MissingBucket, StorageUnavailable

    prompts = _prompts(args.prompts)
    datasets = args.dataset or list(prompts) or load_config(args.config).dataset_names
    overrides = {"datasets": [{"name": n, "prompts": path} for n, path in prompts.items()]}
    if args.date is not None and not (len(args.date) == 10 and args.date[4] == "-" and args.date[7] == "-"):
        raise UserError(f"--date {args.date!r}: expected YYYY-MM-DD")
    run, store = cli_run(args, args.run_key, datasets, overrides, bucket=args.bucket, prefix=args.prefix)
    run = dataclasses.replace(run, dry_run=True, date=args.date)
    if args.offline:
        store = OfflineStore()
    try:
        plans = {name: pipeline.load_route(run, store, name, write_plan=False).plan for name in datasets}
    except (StorageUnavailable, MissingBucket) as exc:  # earlier runs not readable: say how to plan without
        raise type(exc)(f"{exc} (--offline plans from the config alone, without earlier runs)") from None
    plan = run_plan(run, plans)
    print(json.dumps(plan, indent=1, default=str) if runs.JSON_OUTPUT else format_plan(plan))
    return 0
