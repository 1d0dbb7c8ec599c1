"""Reading the rows to validate: JSONL lines, Parquet rows or a stage's Arrow batches, each one a
checked `InputRow` (sample_id, engine ids, how it stopped, the tools offered) or a `BadRow` that
names its line and field; a bad row is never a crash."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_data import json_records
from eagle3_data.chat_format import normalize_finish_reason
from eagle3_data.errors import UserError


@dataclass
class InputRow:
    where: str  # "line 12" or "row 12": how a person finds the row in the input
    sample_id: str
    output_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None (infer from the ids)
    matched: int | str | None = None  # the engine's finish_reason.matched: a stop id or a stop string
    tools: list[dict[str, Any]] | None = None  # the tools offered; None = unknown
    history_tool_calls: int | None = None  # tool calls of the prompt's assistant turns; None = unknown


@dataclass
class BadRow:
    where: str
    sample_id: str | None
    field: str
    error: str

    def message(self) -> str:
        sid = f" (sample_id {self.sample_id})" if self.sample_id else ""
        return f"{self.where}{sid}: field {self.field!r}: {self.error}"

    def to_json(self) -> dict[str, Any]:
        return {"row": self.where, "sample_id": self.sample_id, "field": self.field, "error": self.error}


def _engine_finish(record: dict[str, Any]) -> tuple[Any, Any]:
    """(finish_reason, matched) as the engine gave them: a `finish_reason` object, the
    provenance's `finish_reason` (local generation rows), or `matched_stop` (OpenAI-style)."""
    finish = record.get("finish_reason")
    matched = record.get("matched_stop")
    prov = record.get("provenance")
    if isinstance(prov, str) and prov:
        try:
            prov = json_records.loads(prov)
        except ValueError:  # unreadable (or refused) provenance: the finish comes from the row alone
            prov = None
    engine = prov.get("finish_reason") if isinstance(prov, dict) else None
    for obj in (finish, engine):
        if isinstance(obj, dict):
            matched = obj.get("matched", matched) if matched is None else matched
            if obj is finish:
                finish = obj.get("type")
    return finish, matched


def _check_row(where: str, record: Any, vocab_size: int, ints_checked: bool = False) -> InputRow | BadRow:
    if not isinstance(record, dict):
        return BadRow(where, None, "<row>", "not a JSON object")
    sid = record.get("sample_id")
    if not isinstance(sid, str) or not sid:
        return BadRow(where, None, "sample_id", "missing or not a non-empty string")
    ids = record.get("output_ids")
    if ids is None:
        return BadRow(where, sid, "output_ids", "missing")
    if not isinstance(ids, list):
        return BadRow(where, sid, "output_ids", f"not a list of ints ({type(ids).__name__})")
    if not ints_checked and ids and set(map(type, ids)) != {int}:
        bad = next(i for i in ids if type(i) is not int)
        return BadRow(where, sid, "output_ids", f"non-integer id {bad!r}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        return BadRow(where, sid, "output_ids", f"id {bad} outside the vocabulary (0..{vocab_size - 1})")
    finish, matched = _engine_finish(record)
    if finish is not None:
        try:
            finish = normalize_finish_reason(finish)
        except UserError:
            return BadRow(where, sid, "finish_reason", f"{finish!r} is not 'stop' or 'length'")
    if matched is not None and (isinstance(matched, bool) or not isinstance(matched, (int, str))):
        return BadRow(where, sid, "finish_reason.matched", f"{matched!r} is not a token id or a stop string")
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = _json_column(tools, "tools", where, sid)
        if isinstance(tools, BadRow):
            return tools
    if "tools" in record and tools is None:
        tools = []  # the column exists and says: none offered
    if tools is not None and not isinstance(tools, list):
        return BadRow(where, sid, "tools", "not a list of OpenAI tools")
    history = record.get("messages")
    if isinstance(history, str):
        # no call in it: no need to parse a long conversation
        history = _json_column(history, "messages", where, sid) if '"tool_calls"' in history else 0
        if isinstance(history, BadRow):
            return history
    if isinstance(history, list):
        history = sum(
            len(m.get("tool_calls") or []) for m in history if isinstance(m, dict) and m.get("role") == "assistant"
        )
    elif history is not None and not isinstance(history, int):
        return BadRow(where, sid, "messages", "not a list of chat messages")
    return InputRow(where, sid, ids, finish, matched, tools, history)


def _json_column(text: str, field: str, where: str, sid: str) -> Any:
    """A column holding JSON text, parsed like a line (json_records: depth, surrogates), or the BadRow."""
    try:
        return json_records.loads(text)
    except json_records.JsonRefused as exc:
        return BadRow(where, sid, json_records.join_field(field, exc.field), exc.reason)
    except json.JSONDecodeError as exc:
        return BadRow(where, sid, field, f"not valid JSON ({exc.msg})")


def rows_from_jsonl(path: str | Path, vocab_size: int) -> Iterator[InputRow | BadRow]:
    """One row per line, read lazily; a line that is not JSON (or not UTF-8) is a bad row, not a crash."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json_records.loads(line)
            except json_records.JsonRefused as exc:
                yield BadRow(f"line {n}", None, exc.field or "<line>", exc.reason)
                continue
            except json.JSONDecodeError as exc:
                yield BadRow(f"line {n}", None, "<line>", f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            except ValueError as exc:  # bytes that are not UTF-8
                yield BadRow(f"line {n}", None, "<line>", f"not UTF-8 text ({exc})")
                continue
            yield _check_row(f"line {n}", record, vocab_size)


# Read when present: the engine's finish (finish_reason, and provenance's finish_reason with its
# `matched`), the tools offered (a generation rows' `tools` column: null = none offered) and the
# prompt's messages (the tool calls before this turn, from which a server numbers call ids).
OPTIONAL_COLUMNS = ("finish_reason", "provenance", "tools", "messages")
COLUMNS = ("sample_id", "output_ids", *OPTIONAL_COLUMNS)


def rows_from_batches(batches: Iterable[Any], vocab_size: int) -> Iterator[InputRow | BadRow]:
    """Rows from Arrow record batches (Parquet read by batches, or the DAG's S3 reader); reads
    COLUMNS, of which only sample_id and output_ids are required."""
    import pyarrow as pa

    start = 0
    for batch in batches:
        names = batch.schema.names
        for required in ("sample_id", "output_ids"):
            if required not in names:
                raise UserError(f"input has no column {required!r} (columns: {', '.join(names)})")
        col = batch.column("output_ids")
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        if not (is_list and pa.types.is_integer(col.type.value_type)):
            raise UserError(f"column 'output_ids' has type {col.type}, not a list of integers")
        sids = batch.column("sample_id").to_pylist()
        optional = {c: batch.column(c).to_pylist() for c in OPTIONAL_COLUMNS if c in names}
        values = col.values.to_numpy(zero_copy_only=False)  # the whole batch's ids, one array
        offsets = col.offsets.to_numpy()
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        for i, sid in enumerate(sids):
            ids = values[offsets[i] : offsets[i + 1]].tolist() if valid[i] else None
            record = {"sample_id": sid, "output_ids": ids, **{c: v[i] for c, v in optional.items()}}
            yield _check_row(f"row {start + i + 1}", record, vocab_size, ints_checked=True)
        start += len(sids)


def rows_from_file(path: str | Path, vocab_size: int, batch_rows: int = 1024) -> Iterator[InputRow | BadRow]:
    """JSONL (line by line) or Parquet (batch by batch): memory does not grow with the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(p)
        except Exception as exc:  # pyarrow raises several types for a non-Parquet file
            raise UserError(f"--input {path}: not a readable Parquet file ({exc})") from exc
        cols = [c for c in COLUMNS if c in pf.schema_arrow.names]
        return rows_from_batches(pf.iter_batches(batch_size=batch_rows, columns=cols), vocab_size)
    return rows_from_jsonl(p, vocab_size)
