"""`eagle3-data merge`: validated generations -> shuffled training shards in S3.

`--input s3://.../runs/R/validate/D` (repeat per dataset; any stage URI of the dataset in run R
names it) runs the pipeline's merge of run R: the datasets whose gate passed, into
`runs/R/merge/all`, the stage the DAG's merge writes and reuses. `--out-run-key K` instead merges
the given generation stages (of any runs) as they are, with the flags' settings, under
`runs/K/merge/{--out-dataset}`: an expert's tool that checks no gate.
"""

from __future__ import annotations

import argparse
from typing import Any

from eagle3_data.cli.runs import add_config_arg, add_fresh_arg, add_store_args, cli_run, parse_stage_uri, printed


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("merge", help="merge a run's validated datasets (or given generation stages) into shards")
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="S3_URI",
        help="a stage of each dataset, s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET (repeat for each)",
    )
    p.add_argument(
        "--out-run-key",
        help="merge the given generation stages as they are, under runs/{key}/merge/ "
        "(no gate checked); without it: the run's pipeline merge",
    )
    p.add_argument("--out-dataset", default="all")
    p.add_argument("--max-length", type=int, help="tokens per sample (default: the config's merge.max_length)")
    p.add_argument(
        "--length-policy",
        choices=["truncate", "drop"],
        help="longer samples: cut at --max-length (SpecForge) or drop (Model-Optimizer)",
    )
    p.add_argument("--shard-tokens", type=int, help="target tokens per shard (default: the config's)")
    p.add_argument("--seed", type=int, help="shuffle seed (default: the config's)")
    p.add_argument(
        "--tokens-per-bucket",
        type=int,
        default=None,
        help="memory bound of the external shuffle (~8 bytes per token; default 16.8M tokens)",
    )
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _merge_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v
        for k, v in (
            ("max_length", args.max_length),
            ("length_policy", args.length_policy),
            ("shard_tokens", args.shard_tokens),
            ("seed", args.seed),
        )
        if v is not None
    }


def _run(args: argparse.Namespace) -> int:
    import json

    from eagle3_data.errors import UserError

    parsed = [parse_stage_uri(u) for u in args.input]
    if len({(b, p) for b, p, _ in parsed}) > 1:
        raise UserError("--input: all inputs must live in the same bucket and prefix")
    bucket, prefix, _ = parsed[0]
    # the flags override the config's `merge` section, validated with it (a bad value: one line naming the key)
    overrides = {"merge": settings} if (settings := _merge_settings(args)) else {}
    datasets = list(dict.fromkeys(ref.dataset for _, _, ref in parsed))
    if args.out_run_key is None:
        from eagle3_data import pipeline

        runs = {ref.run_key for _, _, ref in parsed}
        if len(runs) > 1:
            raise UserError(
                f"--input: stages of several runs ({', '.join(sorted(runs))}): a run's merge takes one run; "
                "--out-run-key merges stages of several"
            )
        run, store = cli_run(args, runs.pop(), datasets, overrides, bucket=bucket, prefix=prefix)
        print(printed(pipeline.merge(run, store)))
        return 0
    from eagle3_data.runs.run import output_format
    from eagle3_data.stages.merge.datasets import MergeContext, merge_datasets

    run, store = cli_run(args, args.out_run_key, datasets, overrides, bucket=bucket, prefix=prefix)
    summary = merge_datasets(
        store,
        [ref for _, _, ref in parsed],
        args.out_run_key,
        run.config.merge,
        out_dataset=args.out_dataset,
        # the tokenizer's vocabulary: ids outside it are refused, and the draft vocabulary's t2d spans it
        vocab_size=output_format(run, store, template=False).vocab_size,
        context=MergeContext(**({"tokens_per_bucket": args.tokens_per_bucket} if args.tokens_per_bucket else {})),
    )
    print(
        json.dumps(
            {
                "uri": summary["uri"],
                "shards": len(summary["shards"]),
                "totals": summary["totals"],
                "datasets": summary["datasets"],
            },
            indent=1,
        )
    )
    return 0
