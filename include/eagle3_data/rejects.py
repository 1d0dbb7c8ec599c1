"""Rejected rows of the row stages after generation (reconstruct, validate): kept and shown.

A row a stage cannot use was paid for; dropping it silently would hide both the cost and the
defect. So such a stage writes `rejects.parquet` beside its parts in the one rejects schema
(`schemas.REJECTS`, the one prompt loading uses: dataset, source, line, field, reason, raw), logs
a count per kind of reject with the first few of each, and when rows came in but none was
accepted it fails before its manifest: an empty stage would otherwise be reused as if complete.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

from eagle3_data.errors import UserError

REJECTS_FILE = "rejects.parquet"
_FIELD = re.compile(r"field '([^']+)'")


def reject(dataset: str, source: str, line: int, field: str, reason: str, raw: Any = None) -> dict:
    """One reject record: `line` is the 1-based row of `source` in read order."""
    text = raw if isinstance(raw, str) or raw is None else json.dumps(raw, ensure_ascii=False, default=str)
    return {"dataset": dataset, "source": source, "line": line, "field": field, "reason": reason,
            "raw": None if text is None else text[:2000]}


def field_of(message: str, default: str = "row") -> str:
    """The field a one-line UserError names ("...: field 'tool_calls' is ..."), else `default`."""
    found = _FIELD.search(message)
    return found.group(1) if found else default


def rejects_parquet(rejects: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_data.schemas import schema_for

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rejects, schema=schema_for("rejects")), sink, compression="zstd")
    return sink.getvalue()


def reject_kind(r: dict) -> str:
    """The reason a reject shares with others of its kind: field without indices, reason without
    the parenthesised detail (a parser's message), quoted values or numbers."""
    field_ = re.sub(r"\[\d+\]", "[]", r.get("field") or "row")
    reason = re.sub(r"\s*\([^)]*\)", "", r["reason"])
    reason = re.sub(r"'[^']*'|(?<![\w-])\d+(?![\w-])", "…", reason)[:100]
    return f"{field_}: {reason}"


def format_rejects(rejects: list[dict], read: int, what: str, per_kind: int = 3) -> str:
    """A count per kind of reject and the first few of each, with their row and field."""
    if not rejects:
        return f"{what}: {read} rows read, none rejected"
    groups: dict[str, list[dict]] = {}
    for r in rejects:
        groups.setdefault(reject_kind(r), []).append(r)
    lines = [f"{what}: REJECTED {len(rejects)} of {read} rows:"]
    for kind, rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(rows):>6} x {kind}")
        lines += [f"           row {r['line']} field {r['field']}: {r['reason'][:300]}" for r in rows[:per_kind]]
    return "\n".join(lines)


def require_accepted(accepted: int, read: int, rejects: list[dict], what: str, uri: str) -> None:
    """Rows came in and none was accepted: stop before the manifest (nothing is committed)."""
    if read and not accepted:
        first = rejects[0]["reason"] if rejects else "no row was usable"
        raise UserError(f"{what}: 0 of {read} rows accepted ({len(rejects)} rejected; first: {first}); "
                        f"nothing committed; rejects: {uri}")
