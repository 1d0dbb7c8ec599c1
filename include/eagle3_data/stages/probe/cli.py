"""`eagle3-data probe`: the drafter's verdict (eagle3_data.stages.probe.drafter) on a speculators export folder,
or on a run's extraction stage (the DAG's probe task, its JSON written to runs/RUN_KEY/probe/all)."""

from __future__ import annotations

import argparse
from typing import Any

from eagle3_data.cli.runs import add_config_arg, add_fresh_arg, add_store_args, printed, run_of_stage


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("probe", help="train a small EAGLE-3 drafter on the data and score held-out acceptance")
    p.add_argument(
        "--input",
        required=True,
        help="an export-speculators folder (its draft vocabulary beside it), or an extraction stage "
        "s3://BUCKET/[PREFIX/]runs/RUN_KEY/hidden_states/all (writes runs/RUN_KEY/probe/all)",
    )
    p.add_argument("--model", help="folder mode: the target model directory (default: the config's model.source)")
    p.add_argument("--eval-export", help="folder mode: score on this export's rows instead (same rows, other data)")
    p.add_argument("--out", help="folder mode: write the probe's JSON here (default: print it)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="folder mode (default: cuda when there is one)")
    for flag, help_ in (
        ("samples", "train samples at most"),
        ("eval-samples", "held-out samples at most"),
        ("steps", "optimizer steps"),
        ("draft-length", "draft tokens per step (acc_0..acc_{k-1})"),
        ("seed", "the split, the init and the sample order"),
    ):
        p.add_argument(f"--{flag}", type=int, help=f"{help_} (default: the config's probe.{flag.replace('-', '_')})")
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("samples", "eval_samples", "steps", "draft_length", "seed")
    return {"probe": {"when": "always", **{k: getattr(args, k) for k in keys if getattr(args, k) is not None}}}


def _run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3_data.errors import UserError

    if args.input.startswith("s3://"):
        from eagle3_data.runs.results import ProbeSkipped
        from eagle3_data.stages.probe.stage import probe

        if args.out or args.eval_export or args.model:
            raise UserError(
                "--out, --eval-export and --model are for an export folder: a stage's probe uses the "
                "config's model and writes runs/RUN_KEY/probe/all"
            )
        run, store, _ = run_of_stage(args, args.input, ("hidden_states",), _overrides(args))
        result = probe(run, store)
        if isinstance(result, ProbeSkipped):
            raise UserError(f"--input {args.input}: {result.reason}")
        print(printed(result))
        return 0
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.stages.probe.drafter import ExportCheck, default_device, probe_export

    config = load_config(args.config).with_overrides(_overrides(args), where="command line")
    model = Path(args.model or resolve_source(config.model.source))
    if not (model / "config.json").exists():
        raise UserError(f"--model {model}: no config.json there")
    device = args.device or default_device()
    import tempfile

    from eagle3_data.exports.check import read_layout

    source = read_layout(args.input).source if (Path(args.input) / "export_info.json").is_file() else None
    with tempfile.TemporaryDirectory(prefix="eagle3-probe-check-") as work:
        shards = None
        if source and (source.startswith("s3://") or Path(source).is_dir()):
            from eagle3_data.cli.check_export import shard_source

            shards = shard_source(args, source, work)  # the extraction the export came from: the export check
        report = probe_export(
            Path(args.input),
            model,
            config.probe,
            eval_export=Path(args.eval_export) if args.eval_export else None,
            device=device,
            check=None if shards is None else ExportCheck(shards, config.export.check_samples),
        )
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        keys = ("verdict", "verdict_rule", "simulated_acceptance", "acc", "full_acc", "coverage")
        print(json.dumps({k: report[k] for k in keys}))
    else:
        print(text)
    return 0
