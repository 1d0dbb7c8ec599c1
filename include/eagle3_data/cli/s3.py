"""`eagle3-data s3 init`: create the pipeline's bucket, the one deliberate setup step.

Tasks and commands never create buckets: facing a missing one they stop and name this command.
"""

from __future__ import annotations

import argparse

from eagle3_data.cli.runs import add_store_args


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("s3", help="S3 setup")
    sub = p.add_subparsers(dest="s3_command", required=True)
    i = sub.add_parser("init", help="create the bucket (default: the config's storage.bucket) if it does not exist")
    i.add_argument("--bucket", help="bucket name (default: storage.bucket of the config)")
    i.add_argument("--config", help="pipeline YAML (default: $EAGLE3_CONFIG, else the packaged one)")
    add_store_args(i)
    i.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from eagle3_data.storage import ArtifactStore, s3_client

    bucket = args.bucket
    if not bucket:
        from eagle3_data.config import load_config

        bucket = load_config(args.config).storage.bucket
    store = ArtifactStore(s3_client(args.endpoint_url, args.region), bucket=bucket, prefix="")
    created = store.init_bucket()
    print(f"{'created' if created else 'exists'}: s3://{bucket}/ at {store.client.meta.endpoint_url}")
    return 0
