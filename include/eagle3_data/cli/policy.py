"""`eagle3-data score-policy`: the policy check's scoring of one dataset on the local engine.

`--input s3://.../runs/R/reconstruct/D --endpoint URL` runs the pipeline's score_policy stage
of that run (`runs/R/score_policy/D`, the one the DAG reuses and the validate stage reads): the
engine at URL (SGLang or vLLM, per `generation.local.engine`) scores a sample of the dataset's
overflow answers and as many local ones (docs/generation.md, "The policy check").
"""

from __future__ import annotations

import argparse

from eagle3_data.cli.runs import add_config_arg, add_store_args, printed, run_of_stage


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("score-policy", help="score overflow vs local answers on the local engine (the policy check)")
    p.add_argument("--input", required=True, help="a reconstruct stage s3://BUCKET/[PREFIX/]runs/R/reconstruct/D")
    p.add_argument("--endpoint", action="append", default=[], required=True,
                   help="the local engine's base URL (the target model); repeat for several")
    add_config_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline

    run, store, ref = run_of_stage(args, args.input, ("reconstruct",))
    print(printed(pipeline.score_policy(run, store, ref.dataset, args.endpoint)))
    return 0
