"""`eagle3-data validate`: the round-trip gate on local generations (exit 0 pass, 1 fail, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from eagle3_data.errors import GateFailed, UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("validate", help="decode -> parse -> reconstruct -> compare ids; gate on mismatches")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory or s3://bucket/prefix")
    p.add_argument("--input", required=True, help="JSONL or .parquet rows: sample_id, output_ids, [finish_reason, "
                   "matched_stop, provenance, tools]")
    p.add_argument("--report", required=True, help="JSON report to write; a Markdown summary goes beside it")
    p.add_argument("--max-bpe-mismatch-rate", type=float, default=0.10, help="gate on the bpe_only share (default 0.10)")
    p.add_argument("--max-bad-row-rate", type=float, default=0.0, help="gate on the share of bad rows (default 0)")
    p.add_argument("--on-bad-row", choices=["fail", "skip"], default="fail")
    p.add_argument("--workers", type=int, default=0, help="processes (default: one per CPU core)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, required=True,
                   help="the generation mode the rows were made with (required: the rebuild depends on it)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.tokenizer import load_bulk_tokenizer
    from eagle3_data.validate import rows_from_file, validate_to_report
    from eagle3_data.report import render_markdown

    tokenizer = load_bulk_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    fmt = get_output_format(tokenizer, thinking=args.thinking)
    report = validate_to_report(
        fmt,
        lambda: rows_from_file(args.input, fmt.vocab_size),  # two passes: stop convention, then rows
        max_bpe_mismatch_rate=args.max_bpe_mismatch_rate,
        max_bad_row_rate=args.max_bad_row_rate,
        on_bad_row=args.on_bad_row,
        workers=args.workers or os.cpu_count() or 1,
    )
    out = Path(args.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    out.with_suffix(".md").write_text(render_markdown(report))
    counts = " ".join(f"{k}={v}" for k, v in report["counts"].items())
    print(f"{report['samples']} samples: {counts}; gate {'passed' if report['gate']['passed'] else 'FAILED'}; report {out}")
    if not report["samples"]:
        raise UserError(f"--input {args.input}: no valid samples to validate")
    if not report["gate"]["passed"]:
        raise GateFailed("validation gate failed: " + "; ".join(report["gate"]["reasons"]))
    return 0
