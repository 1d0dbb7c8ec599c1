"""`eagle3-data generate local|overflow`: one dataset's generation stage, as the DAG runs it.

The same stage functions as the DAG, in its order: the bucket and the tokenizer audit first (no
spend before they pass), then load + route (`pipeline.load_route`: the prompt file's rows, each
refused one named by line and field in the prompts stage's `rejects.parquet`, routed by the
config's `routing:`), then this side's share of the samples (`pipeline.generate_local` /
`generate_overflow`). A stage committed here is the one a DAG run with the same config and run
key reuses, and the other way round.

Endpoints are required: `--endpoint` (SGLang or vLLM, per `generation.local.engine`) or
`--base-url` (OpenRouter), or `--dev` to run on the dev inference server, a stand-in that the
run's manifests then name. The OpenRouter key is read from the environment (`OPENROUTER_API_KEY`),
as is the local engines' key, for servers started with `--api-key` (`EAGLE3_SGLANG_API_KEY`),
never from a flag: flags end up in `ps` output and shell history.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from eagle3_data.cli.runs import (
    add_config_arg,
    add_fresh_arg,
    add_store_args,
    cli_run,
    dev_server,
    dev_stand_in,
    printed,
)
from eagle3_data.engines.client import API_KEY_ENV
from eagle3_data.errors import UserError

if TYPE_CHECKING:
    from eagle3_data.runs.results import RouteResult
    from eagle3_data.runs.run import Run
    from eagle3_data.storage.store import ArtifactStore

KEY_ENV = "OPENROUTER_API_KEY"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("generate", help="run a generation stage for one dataset (local engine or OpenRouter)")
    sub = p.add_subparsers(dest="engine", required=True)
    for engine, help_ in (
        ("local", "SGLang /generate or vLLM endpoints: exact output ids"),
        ("overflow", "OpenRouter chat completions: text, reconstructed later"),
    ):
        q = sub.add_parser(engine, help=help_)
        q.add_argument("--dataset", required=True)
        q.add_argument(
            "--prompts",
            required=True,
            help="prompt JSONL/Parquet file, save_to_disk folder or s3:// URI "
            "(OpenAI messages + tools, ShareGPT conversations or a prompt string)",
        )
        q.add_argument("--run-key", required=True, help="e.g. date=2026-11-29 or a run name")
        add_config_arg(q)
        add_fresh_arg(q)
        q.add_argument("--bucket", help="S3 bucket (default: the config's storage.bucket)")
        q.add_argument("--prefix", help="S3 key prefix (default: the config's storage.prefix)")
        add_store_args(q)
        q.add_argument("--tokenizer", help="tokenizer dir or s3:// prefix (default: the config's tokenizer.source)")
        q.add_argument(
            "--dev",
            action="store_true",
            help="run on the embedded dev inference server (a stand-in: the manifests say so)",
        )
        q.add_argument("--dev-config", help="fault/rate YAML for the dev inference server (with --dev)")
        q.add_argument(
            "--journal-dir",
            help="local journal of answers not yet committed "
            "(default $EAGLE3_DATA_CACHE/journal, ~/.cache/eagle3-data/journal)",
        )
        q.add_argument("--rows-per-part", type=int)
        q.add_argument(
            "--rerun",
            action="store_true",
            help="reopen a complete stage: re-verify its parts, keep the sound ones, replay the local "
            "journal, and request only what is missing or corrupt",
        )
        if engine == "local":
            q.add_argument("--endpoint", action="append", default=[], help="engine base URL; repeat for data parallel")
            q.add_argument("--in-flight", type=int, help="requests in flight per endpoint")
        else:
            q.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. https://openrouter.ai/api/v1")
            q.add_argument("--model", help="model slug (default: the config's generation.overflow.model)")
            q.add_argument(
                "--max-usd", type=float, help="stop dispatching at this spend (default: the config's max_usd)"
            )
            q.add_argument("--concurrency", type=int)
        q.add_argument(
            "--regenerate",
            choices=["final_turn", "every_turn", "trajectory"],
            help="final_turn: the answer after each row's whole history; every_turn: one sample per user "
            "turn; trajectory: each user turn's assistant turns, recorded tool results spliced in "
            "(default: the config's generation.regenerate)",
        )
        q.add_argument(
            "--history",
            choices=["dataset", "regenerated"],
            help="every_turn/trajectory: the history before a user turn is the dataset's own or the "
            "answers regenerated before it (default: the config's generation.history)",
        )
        q.add_argument(
            "--overflow-fraction",
            type=float,
            help="share of the samples routed to OpenRouter (the DAG's trigger param; default: the config's "
            "routing.overflow_fraction)",
        )
        q.set_defaults(func=_run)


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as config overrides: the config stays the one description of the run."""
    side = "local" if args.engine == "local" else "overflow"
    flags = {"rows_per_part": args.rows_per_part}
    if side == "local":
        flags["in_flight_per_endpoint"] = args.in_flight
    else:
        flags.update(model=args.model, max_usd=args.max_usd, concurrency=args.concurrency)
    out: dict[str, Any] = {"datasets": [{"name": args.dataset, "prompts": args.prompts}]}
    if flags := {k: v for k, v in flags.items() if v is not None}:
        out["generation"] = {side: flags}
    for key in ("regenerate", "history"):
        if getattr(args, key):
            out.setdefault("generation", {})[key] = getattr(args, key)
    if args.tokenizer:
        out["tokenizer"] = {"source": args.tokenizer}
    if args.overflow_fraction is not None:
        out["routing"] = {"overflow_fraction": args.overflow_fraction}
    return out


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline

    given = args.endpoint if args.engine == "local" else args.base_url
    if not given and not args.dev:
        flag = "--endpoint URL (repeat for several)" if args.engine == "local" else "--base-url URL"
        raise UserError(
            f"generate {args.engine}: no endpoint: name it with {flag}, or pass --dev to run on the "
            "dev inference server (a stand-in; the stage's manifests then say so)"
        )
    if given and args.dev:
        raise UserError(f"generate {args.engine}: --dev runs on the dev inference server; drop it to use {given}")
    overrides = overrides_of(args)
    if args.dev:
        overrides.update(dev_stand_in(args, "local_engine" if args.engine == "local" else "overflow_provider"))
    if args.journal_dir:
        os.environ["EAGLE3_JOURNAL_DIR"] = args.journal_dir
    run, store = cli_run(args, args.run_key, [args.dataset], overrides, bucket=args.bucket, prefix=args.prefix)
    pipeline.preflight(run, store)
    pipeline.audit_tokenizer(run, store)  # a wrong special id fails here, before anything is paid
    routed = pipeline.load_route(run, store, args.dataset)
    _print_rejects(store, run, args.dataset, routed)
    with contextlib.ExitStack() as stack:
        url = dev_server(stack, run, args.dev_config) if args.dev else None
        if args.engine == "local":
            endpoints, key = args.endpoint or [url], os.environ.get(API_KEY_ENV)
            result = pipeline.generate_local(run, store, args.dataset, endpoints, key, rerun=args.rerun)
        else:
            key = os.environ.get(KEY_ENV) or ("dev-key-unused" if args.dev else "")
            result = pipeline.generate_overflow(
                run, store, args.dataset, args.base_url or f"{url}/v1", key, rerun=args.rerun
            )
    print(printed(result))
    return 0


def _print_rejects(store: ArtifactStore, run: Run, dataset: str, routed: RouteResult) -> None:
    """The load's refused rows, per reason, as the prompts stage recorded them."""
    from eagle3_data.pipeline import stage_ref
    from eagle3_data.rejects import REJECTS_FILE, format_rejects, read_rejects
    from eagle3_data.stages import PROMPTS

    ref = stage_ref(run, PROMPTS, dataset)
    rejects = read_rejects(store, ref) if routed.counts.get("rejects") else []
    read = routed.counts.get("prompts", 0) + len(rejects)
    print(
        format_rejects(rejects, read, rows=f"prompt rows of {dataset} ({store.uri(ref, REJECTS_FILE)})"),
        file=sys.stderr,
    )
    print(f"routed: {', '.join(f'{k} {v}' for k, v in routed.counts.items())} -> {routed.uri}", file=sys.stderr)
