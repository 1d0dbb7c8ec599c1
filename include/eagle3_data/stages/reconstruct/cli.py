"""`eagle3-data reconstruct`: overflow answers (text) -> output ids with the model's format.

`--input s3://.../runs/R/generate_overflow/D` runs the pipeline's reconstruct stage of that run
(`runs/R/reconstruct/D`, reused by the DAG and reusing the DAG's); `--input FILE --out FILE`
rebuilds a local file of OpenRouter-style rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from eagle3_data.cli.runs import add_config_arg, add_fresh_arg, add_store_args, mode_overrides, printed, run_of_stage


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("reconstruct", help="rebuild output ids from reasoning/content/tool_calls text")
    p.add_argument(
        "--input",
        required=True,
        help="a generate_overflow stage s3://BUCKET/[PREFIX/]runs/R/generate_overflow/D, or a JSONL/.parquet "
        "file of rows: sample_id, reasoning, content, tool_calls, finish_reason, [messages], [tools]",
    )
    p.add_argument(
        "--out",
        help="file mode: JSONL or .parquet: sample_id, finish_reason, output_ids, unreconstructable "
        "(the reason when the text cannot determine the ids; output_ids is then null)",
    )
    p.add_argument("--tokenizer", help="HF tokenizer directory or s3://bucket/prefix (default: the config's)")
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the generation mode the answers were made with (required with a file; a stage: the "
        "config's generation.sampling.thinking)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline
    from eagle3_data.errors import UserError

    if args.input.startswith("s3://"):
        run, store, ref = run_of_stage(args, args.input, ("generate_overflow",), mode_overrides(args))
        print(printed(pipeline.reconstruct(run, store, ref.dataset)))
        return 0
    if not args.out:
        raise UserError("--out is required with a local --input file (an s3:// stage URI writes the reconstruct stage)")
    if args.thinking is None:  # a file carries no run config: the mode must be said, never guessed
        raise UserError(
            "--thinking or --no-thinking is required with a local --input file: the generation mode the "
            "answers were made with (thinking off has no end of reasoning)"
        )
    return _run_file(args)


def _run_file(args: argparse.Namespace) -> int:
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.reconstruction import read_records, reconstruct_rows, row_to_reconstruct
    from eagle3_data.tokenizer import load_bulk_tokenizer

    config = load_config(args.config)
    tokenizer = load_bulk_tokenizer(
        resolve_source(args.tokenizer or config.tokenizer.source), trust_remote_code=args.trust_remote_code
    )
    fmt = get_output_format(tokenizer, config.model.family, thinking=args.thinking)
    rows = (row_to_reconstruct(fmt, record, where) for where, record in read_records(args.input))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    excluded = []

    def results():
        for r, ids in reconstruct_rows(fmt, rows):
            if r.unreconstructable:
                excluded.append(r.sample_id)
            yield {
                "sample_id": r.sample_id,
                "finish_reason": r.finish_reason,
                "output_ids": None if r.unreconstructable else ids,
                "unreconstructable": r.unreconstructable,
            }

    try:
        n = _write(tmp, out.suffix, results())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)  # a failed run leaves no half-written output under the final name
    print(f"reconstructed {n - len(excluded)} samples, {len(excluded)} unreconstructable (output_ids null) -> {out}")
    return 0


def _write(path: Path, suffix: str, records) -> int:
    """Stream records to JSONL, or to Parquet in row groups of 1024."""
    n = 0
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [
                ("sample_id", pa.string()),
                ("finish_reason", pa.string()),
                ("output_ids", pa.list_(pa.int32())),
                ("unreconstructable", pa.string()),
            ]
        )
        with pq.ParquetWriter(path, schema) as writer:
            batch: list[dict[str, Any]] = []
            for rec in records:
                batch.append(rec)
                n += 1
                if len(batch) >= 1024:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        return n
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n
