"""`eagle3-data validate`: the gate (exit 0 pass, 1 fail, 2 bad input).

`--input s3://.../runs/R/{generate_local|reconstruct}/D` runs the pipeline's validate stage of
that run (the local round trip and the overflow billing check; `runs/R/validate/D`, the DAG's
stage); `--input FILE --report FILE` runs the round trip on a local file of engine rows.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from eagle3_data.cli.runs import add_config_arg, add_fresh_arg, add_store_args, mode_overrides, printed, run_of_stage
from eagle3_data.errors import GateFailed, UserError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("validate", help="decode -> parse -> reconstruct -> compare ids; gate on mismatches")
    p.add_argument(
        "--input",
        required=True,
        help="a stage of the run, s3://BUCKET/[PREFIX/]runs/R/reconstruct/D (or "
        "generate_local/D), or a JSONL/.parquet file of rows: sample_id, output_ids, [finish_reason, "
        "matched_stop, provenance, tools]",
    )
    p.add_argument("--report", help="file mode: JSON report to write; a Markdown summary goes beside it")
    p.add_argument("--tokenizer", help="HF tokenizer directory or s3://bucket/prefix (default: the config's)")
    p.add_argument(
        "--max-bpe-mismatch-rate",
        type=float,
        default=None,
        help="gate on the bpe_only share (default: the config's validation threshold)",
    )
    p.add_argument(
        "--max-bad-row-rate", type=float, default=None, help="gate on the share of bad rows (default: the config's)"
    )
    p.add_argument(
        "--on-bad-row", choices=["fail", "skip"], default="fail", help="file mode: stop at a bad row, or count it"
    )
    p.add_argument("--workers", type=int, default=0, help="processes (default: one per CPU core)")
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the generation mode the rows were made with (required with a file; a stage: the config's)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _thresholds(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v
        for k, v in (("max_bpe_mismatch_rate", args.max_bpe_mismatch_rate), ("max_bad_row_rate", args.max_bad_row_rate))
        if v is not None
    }


def _run(args: argparse.Namespace) -> int:
    if args.input.startswith("s3://"):
        from eagle3_data import pipeline

        overrides = mode_overrides(args)
        if thresholds := _thresholds(args):
            overrides["validation"] = thresholds
        run, store, ref = run_of_stage(args, args.input, ("generate_local", "reconstruct"), overrides)
        for needed in ("generate_local", "reconstruct"):
            if not store.is_complete(pipeline.stage_ref(run, needed, ref.dataset)):
                raise UserError(
                    f"validate {ref.dataset}: {store.uri(pipeline.stage_ref(run, needed, ref.dataset))} is not "
                    f"complete: the gate compares the local ids and the reconstructed overflow share (run "
                    f"`eagle3-data generate` and `eagle3-data reconstruct` for run key {run.run_key} first)"
                )
        print(printed(pipeline.validate(run, store, ref.dataset, workers=args.workers or None)))
        return 0
    return _run_file(args)


def _run_file(args: argparse.Namespace) -> int:
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.report import render_markdown
    from eagle3_data.stages.validate import rows_from_file, validate_to_report
    from eagle3_data.tokenizer import load_bulk_tokenizer

    if not args.report:
        raise UserError("--report is required with a local --input file (an s3:// stage URI writes the validate stage)")
    if args.thinking is None:  # a file carries no run config: the mode must be said, never guessed
        raise UserError(
            "--thinking or --no-thinking is required with a local --input file: the generation mode the "
            "rows were made with (the rebuild depends on it)"
        )
    config = load_config(args.config)
    tokenizer = load_bulk_tokenizer(
        resolve_source(args.tokenizer or config.tokenizer.source), trust_remote_code=args.trust_remote_code
    )
    fmt = get_output_format(tokenizer, config.model.family, thinking=args.thinking)
    thresholds = {**config.validation.model_dump(), **_thresholds(args)}
    report = validate_to_report(
        fmt,
        lambda: rows_from_file(args.input, fmt.vocab_size),  # two passes: stop convention, then rows
        max_bpe_mismatch_rate=thresholds["max_bpe_mismatch_rate"],
        max_bad_row_rate=thresholds["max_bad_row_rate"],
        on_bad_row=args.on_bad_row,
        workers=args.workers or os.cpu_count() or 1,
    )
    out = Path(args.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    out.with_suffix(".md").write_text(render_markdown(report))
    counts = " ".join(f"{k}={v}" for k, v in report["counts"].items())
    print(
        f"{report['samples']} samples: {counts}; gate {'passed' if report['gate']['passed'] else 'FAILED'}; report "
        f"{out}"
    )
    if not report["samples"]:
        raise UserError(f"--input {args.input}: no valid samples to validate")
    if not report["gate"]["passed"]:
        raise GateFailed("validation gate failed: " + "; ".join(report["gate"]["reasons"]))
    return 0
