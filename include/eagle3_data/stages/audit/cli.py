"""`eagle3-data tokenizer audit`: derive and round-trip special ids before any spend."""

from __future__ import annotations

import argparse
import json

from eagle3_data.errors import UserError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("tokenizer", help="tokenizer checks")
    sub = p.add_subparsers(dest="tokenizer_command", required=True)
    audit = sub.add_parser("audit", help="derive special ids by name, round-trip them, check expectations")
    audit.add_argument("--tokenizer", required=True, help="HF tokenizer directory or s3://bucket/prefix")
    audit.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="NAME=ID",
        help="an id to check beyond the family's published ones; repeatable",
    )
    audit.add_argument(
        "--family", help="the model family (chat_format name, as model.family); default: read from the tokenizer"
    )
    audit.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own Python code")
    audit.set_defaults(func=_audit)


def parse_expectations(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name or not value.strip().lstrip("-").isdigit():
            raise UserError(f"--expect {item!r}: expected NAME=ID: a special token's name and its id")
        out[name] = int(value)
    return out


def _audit(args: argparse.Namespace) -> int:
    from eagle3_data.stages.audit.tokenizer_audit import audit_tokenizer
    from eagle3_data.tokenizer import load_tokenizer

    expect = parse_expectations(args.expect)
    tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    report = audit_tokenizer(tokenizer, expect, args.family)
    print(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    if not report.passed:
        raise UserError("tokenizer audit failed: " + "; ".join(report.problems))
    return 0
