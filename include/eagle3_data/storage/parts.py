"""What a Parquet part of a stage is: where its progress records live, and the check that a
downloaded part has the columns its manifest's schema version says (the store reads parts with
it, the writer verifies resumed parts with it)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.storage.refs import CorruptArtifact

PROGRESS = "_progress"  # {stage}/_progress/part-N.json: a part counts once its record exists


def check_part_schema(source, expected: pa.Schema, label: str) -> pq.ParquetFile:
    """Open a downloaded part and refuse it, naming part and column, when its footer is unreadable
    or its columns are missing or of another type than the manifest's schema version says."""
    try:
        pf = pq.ParquetFile(source)
        actual = pf.schema_arrow
    except (OSError, pa.ArrowException) as exc:
        raise CorruptArtifact(f"{label}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})") from None
    for field in expected:
        if field.name not in actual.names:
            raise CorruptArtifact(
                f"{label}: column {field.name!r} is missing (schema "
                f"{(expected.metadata or {}).get(b'eagle3.schema', b'?').decode()} needs it)"
            )
        got = actual.field(field.name).type
        if not got.equals(field.type):
            raise CorruptArtifact(f"{label}: column {field.name!r} is {got}, the schema says {field.type}")
    return pf
