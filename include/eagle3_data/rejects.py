"""Rejected rows, kept and shown: prompt loading and the row stages after generation
(reconstruct, validate) share one record, one file and one summary.

A row a stage cannot use may have been paid for; dropping it silently would hide both the cost
and the defect. So such a stage writes `rejects.parquet` beside its parts in the one rejects
schema (`schemas.REJECTS`: dataset, source, line, field, reason, raw), logs a count per kind of
reject with the first few of each, and when rows came in but none was accepted it fails before
its manifest: an empty stage would otherwise be reused as if complete.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from eagle3_data.errors import UserError

if TYPE_CHECKING:
    from eagle3_data.storage.refs import StageRef
    from eagle3_data.storage.store import ArtifactStore

REJECTS_FILE = "rejects.parquet"
_FIELD = re.compile(r"field '([^']+)'")


def reject(dataset: str, source: str, line: int, field: str, reason: str, raw: Any = None) -> dict[str, Any]:
    """One reject record: `line` is the 1-based row of `source` in read order."""
    text = raw if isinstance(raw, str) or raw is None else json.dumps(raw, ensure_ascii=False, default=str)
    return {
        "dataset": dataset,
        "source": source,
        "line": line,
        "field": field,
        "reason": reason,
        "raw": None if text is None else text[:2000],
    }


def field_of(message: str, default: str = "row") -> str:
    """The field a one-line UserError names ("...: field 'tool_calls' is ..."), else `default`."""
    found = _FIELD.search(message)
    return found.group(1) if found else default


def rejects_parquet(rejects: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_data.schemas import schema_for

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rejects, schema=schema_for("rejects")), sink, compression="zstd")
    return sink.getvalue()


def read_rejects(store: ArtifactStore, ref: StageRef) -> list[dict[str, Any]]:
    """A stage's `rejects.parquet` as rows (none when the stage refused nothing or has no file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = store.read_object(ref, REJECTS_FILE)
    return pq.read_table(pa.BufferReader(data)).to_pylist() if data else []


def reject_kind(r: dict[str, Any]) -> str:
    """The reason a reject shares with others of its kind: field without indices, reason without
    its place (a prompt reject's "<file> line N: <field>: "), the parenthesised detail (a
    parser's message), quoted values or numbers."""
    field_ = re.sub(r"\[\d+\]", "[]", r.get("field") or "row")
    reason = r["reason"]
    if r.get("field") and f"{r['field']}: " in reason:
        reason = reason.split(f"{r['field']}: ", 1)[1]
    else:
        reason = re.sub(r"^.*? line \d+: ", "", reason)
    reason = re.sub(r"\s*\([^)]*\)", "", reason)
    reason = re.sub(r"'[^']*'|(?<![\w-])\d+(?![\w-])", "…", reason)[:100]
    return f"{field_}: {reason}"


def reject_groups(rejects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rejects by kind (`reject_kind`), the most common kind first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rejects:
        groups.setdefault(reject_kind(r), []).append(r)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def format_rejects(
    rejects: list[dict[str, Any]], read: int, what: str = "", per_kind: int = 3, rows: str = "rows"
) -> str:
    """A count per kind of reject and the first few of each, with their place: a prompt reject's
    reason starts with its file and line; a stage's reject is shown with its row and field."""
    head = f"{what}: " if what else ""
    if not rejects:
        return f"{head}{read} {rows} read, none rejected"
    lines = [f"{head}REJECTED {len(rejects)} of {read} {rows}:"]
    for kind, group in reject_groups(rejects).items():
        lines.append(f"  {len(group):>6} x {kind}")
        lines += [f"           {_placed(r)[:300]}" for r in group[:per_kind]]
    return "\n".join(lines)


def _placed(r: dict[str, Any]) -> str:
    located = r["reason"].startswith(f"{r['source']} line ")
    return r["reason"] if located else f"row {r['line']} field {r['field']}: {r['reason']}"


def require_accepted(accepted: int, read: int, rejects: list[dict[str, Any]], what: str, uri: str) -> None:
    """Rows came in and none was accepted: stop before the manifest (nothing is committed)."""
    if read and not accepted:
        first = rejects[0]["reason"] if rejects else "no row was usable"
        raise UserError(
            f"{what}: 0 of {read} rows accepted ({len(rejects)} rejected; first: {first}); "
            f"nothing committed; rejects: {uri}"
        )


def require_reject_rate(
    rejects: list[dict[str, Any]],
    read: int,
    max_rate: float,
    what: str,
    setting: str,
    keep: Callable[[], str] | None = None,
) -> None:
    """More than `max_rate` of the `read` rows rejected: a UserError of one line with the count of
    each kind of reject (most common first), the first reject, and where the rejects are
    (`keep()` writes them and returns their URI; only called on failure). Some rows accepted is
    not enough: a broken converter drops most of a dataset and the run would still look green."""
    if not read or len(rejects) <= max_rate * read:
        return
    kinds = "; ".join(f"{len(group)} x {kind}" for kind, group in reject_groups(rejects).items())
    where = f"; rejects: {keep()}" if keep else ""
    raise UserError(
        f"{what}: {len(rejects)} of {read} rows rejected ({len(rejects) / read:.2%}), over {setting} "
        f"{max_rate:.2%}: {kinds}; first: {rejects[0]['reason'][:300]}{where}"
    )
