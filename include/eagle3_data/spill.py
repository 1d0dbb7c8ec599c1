"""Rows spilled to a local Arrow IPC file, so a stage keeps a bounded number of them in memory.

A prompt row carries its whole conversation and tool schema (kilobytes each with a large tool),
so a stage that held every row as Python objects grew by gigabytes at 10^5 prompts. The stages
that must see every row before they can act (routing ranks all sample ids; generation validates
every prompt before the first request) write the rows here as they read them, keep only small
per-row state (ids, counts) in memory, and read the rows back batch by batch. The file is local
to the process (a temp file, removed when the spill is closed or garbage-collected): it is
scratch space, never an artifact. A child forked while a spill exists (an Airflow task from a
warm worker) takes its own copy of the file on first use: the parent keeps appending to and then
removes its own, and the descriptor they would share has one file offset for both.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

BATCH_ROWS = 512  # rows buffered as Python dicts before they become one Arrow batch on disk


class RowSpill:
    """Append rows (dicts of `schema`'s fields), then read them back in order, as often as needed.

    `drop(keys)` hides rows by their `key` column without rewriting the file (rows refused after
    the spill was written, e.g. prompts over the token limit)."""

    def __init__(self, schema: pa.Schema, *, key: str = "sample_id", batch_rows: int = BATCH_ROWS) -> None:
        self.schema, self.key, self.batch_rows = schema, key, batch_rows
        self._open_file()
        self._buffer: list[dict[str, Any]] = []
        self._appended = 0
        self._written_batches = 0  # batches in the file, so a forked child copies exactly these
        self._dropped: set[str] = set()

    def _open_file(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="eagle3-spill-", suffix=".arrows")
        os.close(fd)
        self._pid = os.getpid()
        self._remove = weakref.finalize(self, _unlink, self.path, self._pid)
        self._sink: pa.NativeFile | None = pa.OSFile(self.path, "wb")
        self._writer: pa.ipc.RecordBatchStreamWriter | None = pa.ipc.new_stream(self._sink, self.schema)

    def _own_copy(self) -> None:
        """In a forked child: the parent's rows so far, in a file of this process. Written batches
        are read back from the parent's file (still being appended to, or sealed); buffered rows are
        this process's own copy already."""
        if self._pid == os.getpid():
            return
        parent_path, sealed = self.path, self._writer is None
        self._remove.detach()  # the parent's file is the parent's to remove
        self._open_file()  # (the inherited writer is dropped unclosed: closing would write into the parent's file)
        with pa.OSFile(parent_path, "rb") as source:
            reader = pa.ipc.open_stream(source)
            for _ in range(self._written_batches):
                self._writer.write_batch(reader.read_next_batch())
        if sealed:
            self._seal()

    def append(self, row: dict[str, Any]) -> None:
        self._own_copy()
        if self._writer is None:
            raise RuntimeError("RowSpill: append after the spill was read")
        self._buffer.append(row)
        self._appended += 1
        if len(self._buffer) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            self._writer.write_batch(pa.RecordBatch.from_pylist(self._buffer, schema=self.schema))
            self._written_batches += 1
            self._buffer = []

    def _seal(self) -> None:
        """Writing ends at the first read: the IPC stream needs its end marker to be read back."""
        if self._writer is not None:
            self._flush()
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def drop(self, keys: Iterable[str]) -> None:
        self._dropped.update(keys)

    def __len__(self) -> int:
        return self._appended - len(self._dropped)

    def __bool__(self) -> bool:
        return len(self) > 0

    def batches(self, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The rows not dropped, in append order, one batch of at most `batch_rows` at a time."""
        import pyarrow.compute as pc  # here, not at import: most spills drop nothing

        self._own_copy()
        self._seal()
        dropped = pa.array(sorted(self._dropped), pa.string()) if self._dropped else None
        with pa.OSFile(self.path, "rb") as source:
            for batch in pa.ipc.open_stream(source):
                if dropped is not None:
                    batch = batch.filter(pc.invert(pc.is_in(batch.column(self.key), value_set=dropped)))
                    if not batch.num_rows:
                        continue
                yield batch.select(columns) if columns is not None else batch

    def rows(self, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
        for batch in self.batches(columns):
            yield from batch.to_pylist()

    def close(self) -> None:
        """Remove the file now (else when the spill is garbage-collected or the process exits)."""
        if self._pid != os.getpid():  # a forked child that never used it: nothing of its own to remove
            self._remove.detach()
            return
        with contextlib.suppress(Exception):
            self._seal()
        self._remove()


def _unlink(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child exiting: the file is its parent's
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
