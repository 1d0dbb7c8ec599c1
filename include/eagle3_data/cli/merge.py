"""`eagle3-data merge`: validated generations of all datasets -> shuffled training shards in S3."""

from __future__ import annotations

import argparse


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    p.add_argument("--region", default=None)


def parse_stage_uri(uri: str):
    """`s3://bucket/[prefix/]runs/{run_key}/{stage}/{dataset}[/]` -> (bucket, prefix, StageRef)."""
    from eagle3_data.errors import UserError
    from eagle3_data.storage import StageRef

    parts = uri.removeprefix("s3://").strip("/").split("/") if uri.startswith("s3://") else []
    if len(parts) < 5 or parts[-4] != "runs":
        raise UserError(f"{uri!r}: expected s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET")
    return parts[0], "/".join(parts[1:-4]), StageRef(parts[-3], parts[-2], parts[-1])


def open_store(args: argparse.Namespace, bucket: str, prefix: str):
    from eagle3_data.storage import ArtifactStore, s3_client

    return ArtifactStore(s3_client(args.endpoint_url, args.region), bucket=bucket, prefix=prefix)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("merge", help="merge generation stages into shuffled training shards")
    p.add_argument("--input", action="append", required=True, metavar="S3_URI",
                   help="a generations stage, s3://BUCKET/PREFIX/runs/RUN_KEY/STAGE/DATASET (repeat for each)")
    p.add_argument("--out-run-key", required=True, help="run key to write runs/{key}/merge/{dataset}/ under")
    p.add_argument("--out-dataset", default="all")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per sample (SpecForge uses 2048)")
    p.add_argument("--length-policy", choices=["truncate", "drop"], default="truncate",
                   help="longer samples: cut at --max-length (SpecForge) or drop (Model-Optimizer)")
    p.add_argument("--shard-tokens", type=int, default=1 << 20, help="target tokens per shard")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--tokens-per-bucket", type=int, default=None,
                   help="memory bound of the external shuffle (~8 bytes per token; default 16.8M tokens)")
    add_store_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from eagle3_data.errors import UserError
    from eagle3_data.merge import merge_datasets

    parsed = [parse_stage_uri(u) for u in args.input]
    if len({(b, p) for b, p, _ in parsed}) > 1:
        raise UserError("--input: all inputs must live in the same bucket and prefix")
    bucket, prefix, _ = parsed[0]
    store = open_store(args, bucket, prefix)
    summary = merge_datasets(
        store, [ref for _, _, ref in parsed], args.out_run_key, max_length=args.max_length,
        length_policy=args.length_policy, shard_tokens=args.shard_tokens, seed=args.seed,
        out_dataset=args.out_dataset, **({"tokens_per_bucket": args.tokens_per_bucket} if args.tokens_per_bucket else {}),
    )
    print(json.dumps({"uri": summary["uri"], "shards": len(summary["shards"]), "totals": summary["totals"],
                      "datasets": summary["datasets"]}, indent=1))
    return 0
