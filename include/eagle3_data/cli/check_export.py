"""`eagle3-data check-export`: an export read back by its trainer's own code, each state checked
against the log-probability the extraction recorded for the token it is paired with
(eagle3_data.exports.check). Exit 0 with its figures, 1 naming the first sample and
position that fails, 2 on bad input."""

from __future__ import annotations

import argparse

from eagle3_data.cli.runs import add_config_arg, add_store_args


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "check-export", help="check an export through its trainer's reader: each state beside the token it predicts"
    )
    p.add_argument("--input", required=True, help="an export-speculators or export-specforge folder")
    p.add_argument("--model", help="the target model directory (default: the config's model.source)")
    p.add_argument(
        "--shards",
        help="the extraction it came from: a folder of shards or s3://.../runs/R/hidden_states/all "
        "(default: the source its export_info.json names)",
    )
    rows = p.add_mutually_exclusive_group()
    rows.add_argument(
        "--samples", type=int, help="rows checked, spread over the export (default: the config's export.check_samples)"
    )
    rows.add_argument("--all", action="store_true", help="check every row")
    p.add_argument("--tolerance", type=float, help="nats per position (default: by the exported dtype)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where the LM head runs (default: cuda when there is one)")
    add_config_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def shard_source(args: argparse.Namespace, source: str, work):
    """LocalShards for a folder, StageShards for an extraction stage in the store."""
    from pathlib import Path

    from eagle3_data.errors import UserError
    from eagle3_data.exports.check import LocalShards, StageShards

    if source.startswith("s3://"):
        from eagle3_data.cli.runs import open_store, parse_stage_uri

        bucket, prefix, ref = parse_stage_uri(source)
        return StageShards(open_store(args, bucket, prefix), ref, Path(work))
    folder = Path(source)
    paths = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not paths:
        raise UserError(f"--shards {source}: no extraction shards (.safetensors) there")
    return LocalShards(paths)


def _run(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.errors import UserError
    from eagle3_data.exports.check import check_export, read_layout

    config = load_config(args.config)
    model = Path(args.model or resolve_source(config.model.source))
    if not (model / "config.json").exists():
        raise UserError(f"--model {model}: no config.json there")
    layout = read_layout(args.input)
    source = args.shards or layout.source
    if not source:
        raise UserError(f"--input {args.input}: its export_info.json names no source; give --shards")
    samples = None if args.all else (args.samples if args.samples is not None else config.export.check_samples)
    with tempfile.TemporaryDirectory(prefix="eagle3-check-shards-") as work:
        result = check_export(
            args.input,
            model,
            shard_source(args, source, work),
            samples=samples,
            tolerance=args.tolerance,
            device=args.device,
        )
    print(json.dumps(result, indent=1))
    return 0
