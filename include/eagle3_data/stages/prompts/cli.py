"""`eagle3-data prompts upload | list`: put prompt files where a scheduled or backfill run reads them.

A run with logical date D reads every file under `{prompts root}/{dataset}/date=D/` (the root is
the dataset's `prompts`, default `s3://{bucket}/{prefix}/prompts`). `upload` checks each file with
the same loader the DAG's `load_route` uses, so a file the run would reject rows of is refused
here, naming each bad row (exit 2), instead of being found out at run time; nothing is uploaded
unless every file passes (or `--allow-bad-rows` says to upload them anyway, listing the rows).
S3 credentials and endpoint come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL), as `make cluster`'s env file sets them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_data.errors import UserError

MAX_REPORTED = 20


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("prompts", help="upload prompt files to a dataset's date partition, list partitions")
    sub = p.add_subparsers(dest="prompts_command", required=True)
    up = sub.add_parser("upload", help="validate FILE(s) and write them to {root}/{dataset}/date=YYYY-MM-DD/")
    up.add_argument(
        "files",
        nargs="+",
        type=Path,
        metavar="FILE",
        help=".jsonl, .parquet or .arrow prompt file(s): messages, conversations (ShareGPT) or prompt rows",
    )
    up.add_argument("--dataset", required=True, help="a dataset of the config")
    up.add_argument("--date", required=True, help="the runs' logical date, YYYY-MM-DD")
    up.add_argument("--allow-bad-rows", action="store_true", help="upload even if rows are rejected (they are listed)")
    _common(up)
    up.set_defaults(func=_upload)
    ls = sub.add_parser("list", help="date partitions per dataset: files and bytes")
    ls.add_argument("--dataset", default=None, help="one dataset (default: every dataset of the config)")
    _common(ls)
    ls.set_defaults(func=_list)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="pipeline config (default: $EAGLE3_CONFIG, else the packaged default)"
    )
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: $AWS_ENDPOINT_URL)")
    p.add_argument("--region", default=None)


def _root(config, dataset: str) -> tuple[str, str]:
    """(bucket, key prefix) of the dataset's prompts root; refuses a dataset the config lacks."""
    by_name = {d.name: d for d in config.datasets}
    if dataset not in by_name:
        raise UserError(f"--dataset {dataset!r} is not in the config (datasets: {', '.join(sorted(by_name))})")
    root = by_name[dataset].prompts
    if not root.startswith("s3://"):
        raise UserError(f"dataset {dataset!r} reads prompts from {root!r}, not an s3:// root: nothing to upload to")
    if root.rstrip("/").endswith(tuple(f"{dataset}{s}" for s in (".jsonl", ".parquet"))):
        raise UserError(
            f"dataset {dataset!r} reads the single file {root}: a date partition applies to a prompts root only"
        )
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def _store(args: argparse.Namespace, bucket: str):
    from eagle3_data.storage import ArtifactStore, s3_client

    return ArtifactStore(s3_client(args.endpoint_url, args.region), bucket=bucket, prefix="")


def _upload(args: argparse.Namespace) -> int:
    from eagle3_data.config import load_config
    from eagle3_data.images import ImageSink
    from eagle3_data.prompt_files import DATE_PATTERN, PROMPT_FILE_SUFFIXES
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts

    if not DATE_PATTERN.fullmatch(args.date):
        raise UserError(f"--date {args.date!r}: expected YYYY-MM-DD")
    config = load_config(args.config)
    bucket, prefix = _root(config, args.dataset)
    g = config.generation
    shape = PromptShape(sampling=g.sampling.model_dump(), repeats=g.repeats, regenerate=g.regenerate, history=g.history)
    rejects, counts, images = [], [], []
    for f in args.files:
        if not f.is_file():
            raise UserError(f"{f}: no such file")
        if f.suffix not in PROMPT_FILE_SUFFIXES:
            raise UserError(f"{f}: expected a {' or '.join(PROMPT_FILE_SUFFIXES)} file")
        sink = ImageSink(None, config.limits.max_image_bytes)  # images checked here, stored by the run's prompts stage
        load = load_prompts(str(f), args.dataset, shape, images=sink)
        rejects += load.rejects
        counts.append((f, load.counts))
        images += [(f, Path(s)) for s in sink.seen if not s.startswith(("data:", "s3://"))]  # files beside the prompts
    for r in rejects[:MAX_REPORTED]:
        print(f"bad row: {r['reason']}", file=sys.stderr)
    if len(rejects) > MAX_REPORTED:
        print(f"... and {len(rejects) - MAX_REPORTED} more bad rows", file=sys.stderr)
    if rejects and not args.allow_bad_rows:
        raise UserError(
            f"{len(rejects)} bad row(s) in {', '.join(str(f) for f, c in counts if c['rejected'])}: "
            f"nothing uploaded (fix them, or pass --allow-bad-rows to upload and let the run reject them)"
        )
    store = _store(args, bucket)
    for f, c in counts:
        key = f"{prefix}/{args.dataset}/date={args.date}/{f.name}".lstrip("/")
        uri = store.put_object(key, f.read_bytes())
        print(f"{uri}: {c['rows']} prompts ({c['rejected']} rejected, {c['duplicates']} duplicates)")
    for f, image in images:  # where the prompts name them: relative to the prompt file
        key = f"{prefix}/{args.dataset}/date={args.date}/{image.relative_to(f.parent).as_posix()}".lstrip("/")
        print(f"{store.put_object(key, image.read_bytes())}: image")
    return 0


def _list(args: argparse.Namespace) -> int:
    from eagle3_data.config import load_config

    config = load_config(args.config)
    names = [args.dataset] if args.dataset else [d.name for d in config.datasets]
    print(f"{'dataset':16s} {'date':10s} {'files':>5s} {'bytes':>12s}")
    for name in names:
        bucket, prefix = _root(config, name)
        base = f"{prefix}/{name}/".lstrip("/")
        parts: dict[str, list[int]] = {}
        for obj in _store(args, bucket).list_objects(base):
            date = obj["Key"][len(base) :].split("/", 1)[0]
            if date.startswith("date="):
                parts.setdefault(date[5:], []).append(obj["Size"])
        if not parts:
            print(f"{name:16s} {'-':10s} {0:5d} {0:12d}   (no partition under s3://{bucket}/{base})")
        for date, sizes in sorted(parts.items()):
            print(f"{name:16s} {date:10s} {len(sizes):5d} {sum(sizes):12d}")
    return 0
