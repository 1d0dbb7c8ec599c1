"""`eagle3-data score-policy`: the policy check's scoring of one dataset on the local engine.

`--input s3://.../runs/R/reconstruct/D --endpoint URL` runs the pipeline's score_policy stage
of that run (`runs/R/score_policy/D`, the one the DAG reuses and the validate stage reads): the
engine at URL (SGLang or vLLM, per `generation.local.engine`) scores a sample of the dataset's
overflow answers and as many local ones (docs/generation.md, "The policy check"). `--dev` scores
on the dev inference server instead, as `generate local --dev` generates on it (a stand-in: the
stage's manifest says so). For an engine started with `--api-key`, the key is read from the
environment (`EAGLE3_SGLANG_API_KEY`), as `generate local` reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import os

from eagle3_data.cli.runs import (
    add_config_arg,
    add_fresh_arg,
    add_store_args,
    dev_server,
    dev_stand_in,
    printed,
    run_of_stage,
)
from eagle3_data.engines.client import API_KEY_ENV
from eagle3_data.errors import UserError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "score-policy", help="score overflow vs local answers on the local engine (the policy check)"
    )
    p.add_argument("--input", required=True, help="a reconstruct stage s3://BUCKET/[PREFIX/]runs/R/reconstruct/D")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="the local engine's base URL (the target model); repeat for several",
    )
    p.add_argument(
        "--dev",
        action="store_true",
        help="score on the embedded dev inference server (a stand-in: the manifest says so)",
    )
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline

    if bool(args.endpoint) == args.dev:
        raise UserError(
            "score-policy: name the local engine with --endpoint URL (repeat for several), or pass --dev "
            "to score on the dev inference server (a stand-in), not both"
        )
    run, store, ref = run_of_stage(
        args, args.input, ("reconstruct",), dev_stand_in(args, "local_engine") if args.dev else None
    )
    with contextlib.ExitStack() as stack:
        endpoints = [dev_server(stack, run)] if args.dev else args.endpoint
        print(printed(pipeline.score_policy(run, store, ref.dataset, endpoints, os.environ.get(API_KEY_ENV))))
    return 0
