"""Checkpointing Parquet writer: a killed worker loses at most the rows of one unfinished part.

Commit protocol, per part n:
  1. upload part-n.parquet (bytes + sha256 in its metadata)
  2. upload _progress/part-n.json (sha256, rows, sample_ids, fingerprint of params and inputs)
A part counts only once step 2 happened. A resuming writer therefore trusts progress records
whose part exists with the recorded size, deletes parts without one (orphans of a kill between 1
and 2; their rows are produced again, never counted twice) and continues numbering after the last
committed part. The manifest is written by `commit()`, last.

One writer per stage: `_open` takes the stage's lease (storage/lease.py) before it reads or
deletes anything, every part and the manifest are written only while the lease is held, and a
resuming writer re-hashes every committed part against its progress record before trusting it
(a part whose bytes changed is named, discarded, and its rows produced again).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.canonical import canonical_json
from eagle3_data.errors import StageConflict, UserError
from eagle3_data.schemas import schema_for
from eagle3_data.storage.archive import archive_stage
from eagle3_data.storage.lease import DEFAULT_TTL_S, Lease, acquire_lease, is_lease
from eagle3_data.storage.parts import PROGRESS, check_part_schema
from eagle3_data.storage.refs import CorruptArtifact, StageRef, part_name, part_number
from eagle3_data.storage.store import StageOrigin

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

log = logging.getLogger(__name__)

ROW_GROUP_ROWS = 1024  # streaming readers get at most this many rows per row group


class StageWriter:
    """A checkpointing writer of one stage; use it as a context manager:
    `with StageWriter(store, ref, "generations", params=..., inputs=...) as w: ...; w.commit()`.

    A complete stage is refused (`StageConflict`): committed means immutable. With `reopen=True`
    its parts are resumed like a killed attempt's (each re-verified by sha256), so only what is
    missing or corrupt is produced again. `fresh=True` discards what is there, complete or not
    (the pipeline passes it only for a stage a person named in `--fresh`, or for a derived stage's
    unfinished attempt), after copying it to the archive first when `archive=True` (paid answers:
    storage/archive.py)."""

    def __init__(
        self,
        store: ArtifactStore,
        ref: StageRef,
        schema: str,
        *,
        rows_per_part: int = 256,
        params: dict[str, Any] | None = None,
        inputs: Iterable[StageRef | dict[str, Any]] | None = None,
        tokenizer_sha256: str | None = None,
        template_sha256: str | None = None,
        fresh: bool = False,
        archive: bool = False,
        reopen: bool = False,
        part_summary: Callable[[pa.Table], dict[str, Any]] | None = None,
        lease_ttl_s: float | None = None,
    ) -> None:
        if rows_per_part < 1:
            raise UserError(f"rows_per_part must be >= 1, got {rows_per_part}")
        self.store = store
        self.ref = ref
        self.schema_name = schema
        self.schema = schema_for(schema)
        self.rows_per_part = rows_per_part
        self.params = params or {}
        self.inputs = store.input_records(inputs)
        self.tokenizer_sha256 = tokenizer_sha256
        self.template_sha256 = template_sha256
        self.fresh = fresh
        self.archive = archive
        self.reopen = reopen
        self.part_summary = part_summary
        self.lease_ttl_s = lease_ttl_s or DEFAULT_TTL_S
        self.lease: Lease | None = None
        self._records: list[dict[str, Any]] = []  # progress records of committed parts (verified)
        self.fingerprint = hashlib.sha256(
            canonical_json(
                {
                    "schema": [schema, self.schema.metadata[b"eagle3.schema_version"].decode()],
                    "params": self.params,
                    "inputs": self.inputs,
                    "tokenizer_sha256": tokenizer_sha256,
                    "template_sha256": template_sha256,
                }
            ).encode()
        ).hexdigest()
        self._parts: list[dict[str, Any]] = []
        self._committed_ids: set[str] = set()  # sample_ids in committed parts
        self._seen: set[str] = set()  # committed or buffered sample_ids
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._next_part = 0
        self._stats = {
            "resumed_parts": 0,
            "resumed_rows": 0,
            "orphan_parts_removed": 0,
            "corrupt_parts_discarded": 0,
            "duplicates_skipped": 0,
        }
        self._committed = False
        self._opened = False
        self.unsaved_rows = 0  # rows still buffered when the writer exited on an error (not in S3)

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> StageWriter:
        self.lease = acquire_lease(self.store, self.ref, ttl_s=self.lease_ttl_s)
        try:
            self._open()
        except BaseException:
            self.lease.release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._committed:
                return
            if exc_type is None:
                raise RuntimeError(
                    f"writer for {self.store.uri(self.ref)} closed without commit(): the stage stays incomplete"
                )
            try:  # the rows already produced are paid for: checkpoint them before the error propagates
                self.flush()
            except Exception as err:
                self.unsaved_rows = self._buffered
                log.warning(
                    "could not checkpoint %d buffered rows of %s (%s): they are NOT in S3; the next attempt "
                    "produces them again unless a local journal holds them",
                    self._buffered,
                    self.store.uri(self.ref),
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                )
        finally:
            if self.lease is not None:
                self.lease.release()

    def _open(self) -> None:
        """Every check that can refuse runs before the first write (the lease aside): a committed
        stage is never overwritten (only `reopen` resumes one), and an unfinished attempt made
        from other params, inputs or tokenizer is never mixed in or discarded unless `fresh`."""
        store, ref = self.store, self.ref
        complete = store.is_complete(ref)
        uri = store.uri(ref)
        if complete and not self.reopen:
            raise StageConflict(
                f"{uri} is committed: a committed stage is never overwritten. Reuse it, or replace it on "
                f"purpose with the stage command's --fresh (the DAG's fresh_stages param) or `eagle3-data stage "
                f"discard {uri}`"
            )
        records = store.progress_records(ref)
        foreign = [r for r in records if r.get("fingerprint") != self.fingerprint]
        if foreign and not self.fresh:
            raise StageConflict(
                f"{uri} holds {len(foreign)} committed parts of an unfinished attempt made from other params, "
                f"inputs or tokenizer than this run's: resuming would mix them. Rerun with the inputs and config "
                f"that made them (it resumes), use another run key, or replace them with --fresh {ref.stage} "
                f"(the DAG's fresh_stages param{'; paid answers are archived and reused' if self.archive else ''})"
            )
        if self.fresh:
            if self.archive:
                archive_stage(store, ref, f"replaced by a fresh {ref.stage} run")
            store.invalidate(ref)
            self._discard_everything()
            records = []
        elif complete:  # reopen: the parts are kept and resumed, each re-verified
            store.invalidate(ref)
        objects = {name: o["Size"] for name, o in store.objects(ref).items()}
        valid = []
        for record in records:
            if objects.get(record["name"]) != record["bytes"]:
                problem = "progress record without its part (or of another size)"
            else:
                problem = self._verify_part(record)
            if problem is None:
                valid.append(record)
            else:
                log.warning(
                    "%s: %s; discarded, its %d rows will be produced again",
                    store.uri(ref, record["name"]),
                    problem,
                    record.get("rows", 0),
                )
                self._stats["corrupt_parts_discarded"] += objects.get(record["name"]) is not None
                store.delete_objects(ref, [f"{PROGRESS}/{record['name'][: -len('.parquet')]}.json"])
                store.delete_objects(ref, [record["name"]])
                objects.pop(record["name"], None)
        valid_names = {r["name"] for r in valid}
        orphans = [name for name in objects if part_number(name) is not None and name not in valid_names]
        if orphans:
            log.warning(
                "%s: removing %d parts of a killed attempt that never got a progress record",
                store.uri(ref),
                len(orphans),
            )
            store.delete_objects(ref, orphans)
        self._records = valid
        for record in valid:
            self._parts.append({k: record[k] for k in ("name", "rows", "bytes", "sha256")})
            self._committed_ids.update(record["sample_ids"])
        self._seen = set(self._committed_ids)
        self._next_part = max((r["part"] for r in valid), default=-1) + 1
        self._stats.update(
            resumed_parts=len(valid), resumed_rows=sum(r["rows"] for r in valid), orphan_parts_removed=len(orphans)
        )
        if valid:
            log.info(
                "%s: resuming after %d committed parts (%d rows)",
                store.uri(ref),
                len(valid),
                self._stats["resumed_rows"],
            )
        self._opened = True

    def _verify_part(self, record: dict[str, Any]) -> str | None:
        """Why a committed part must not be trusted (bytes changed since its record, unreadable
        footer, schema not this stage's), or None. Costs one download per part, once per resume."""
        try:
            with self.store.open_verified(
                self.ref, record["name"], sha256=record["sha256"], nbytes=record["bytes"]
            ) as f:
                check_part_schema(f, self.schema, self.store.uri(self.ref, record["name"]))
        except CorruptArtifact as exc:
            return str(exc).split(": rerun the stage")[0].removeprefix(self.store.uri(self.ref, record["name"]) + " ")
        return None

    def committed_records(self) -> list[dict[str, Any]]:
        """Progress records of the verified committed parts (with `summary` when a part_summary was given)."""
        self._require_open()
        return [dict(r) for r in self._records]

    def _discard_everything(self) -> None:
        """Progress records first, so a kill midway leaves nothing a resume would count."""
        names = [name for name in self.store.objects(self.ref) if not is_lease(name)]
        progress = [name for name in names if name.startswith(PROGRESS + "/")]
        self.store.delete_objects(self.ref, progress)
        self.store.delete_objects(self.ref, [name for name in names if name not in set(progress)])

    # -- writing ----------------------------------------------------------------------------------
    def committed_sample_ids(self) -> set[str]:
        """sample_ids committed in parts (by earlier attempts and this one); buffered rows excluded."""
        self._require_open()
        return set(self._committed_ids)

    @property
    def rows_committed(self) -> int:
        return sum(p["rows"] for p in self._parts)

    def write(self, rows: Sequence[dict[str, Any]] | pa.Table) -> int:
        """Buffer rows; every `rows_per_part` rows become a committed part. Rows whose sample_id is
        already committed or buffered are skipped (counted in the manifest). Returns rows accepted."""
        self._require_open()
        table = self._to_table(rows)
        ids = table.column("sample_id").to_pylist()
        keep = []
        for i, sid in enumerate(ids):
            if sid is None:
                raise UserError(f"{self.store.uri(self.ref)}: row {i} of this write has no sample_id")
            if sid in self._seen:
                self._stats["duplicates_skipped"] += 1
                continue
            self._seen.add(sid)
            keep.append(i)
        if len(keep) != len(ids):
            table = table.take(keep)
        if table.num_rows:
            self._buffer.append(table)
            self._buffered += table.num_rows
        while self._buffered >= self.rows_per_part:
            whole = pa.concat_tables(self._buffer)
            self._buffer = [whole]  # one table; rows leave the buffer only once their part is committed
            self._write_part(whole.slice(0, self.rows_per_part))
            self._buffer = [whole.slice(self.rows_per_part)] if whole.num_rows > self.rows_per_part else []
            self._buffered = whole.num_rows - self.rows_per_part
        return len(keep)

    def flush(self) -> None:
        """Commit the buffered rows as a part now, however few; on an upload error they stay buffered."""
        self._require_open()
        if self._buffered:
            whole = pa.concat_tables(self._buffer)
            self._buffer = [whole]
            self._write_part(whole)
            self._buffer, self._buffered = [], 0

    def commit(self, extra: dict[str, Any] | None = None, files: Iterable[str] = ()) -> dict[str, Any]:
        """Flush, then write the manifest, last. `files`: side files already put (reports) that the
        manifest should cover with their sha256."""
        self._require_open()
        self.flush()
        self.lease.renew()  # fencing: a writer whose lease was taken over never writes a manifest
        self._check_parts_unchanged()
        manifest = self.store.write_manifest(
            self.ref,
            schema={"name": self.schema_name, "version": int(self.schema.metadata[b"eagle3.schema_version"])},
            parts=list(self._parts),
            files=self.store.file_entries(self.ref, files),
            origin=StageOrigin(self.inputs, self.params, self.tokenizer_sha256, self.template_sha256),
            extra={**(extra or {}), "writer": dict(self._stats)},
        )
        self._committed = True
        return manifest

    # -- internals ----------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if not self._opened:
            raise RuntimeError("use the writer as a context manager: `with StageWriter(store, ...) as w:`")
        if self._committed:
            raise RuntimeError(f"writer for {self.store.uri(self.ref)} is already committed")

    def _to_table(self, rows: Sequence[dict[str, Any]] | pa.Table) -> pa.Table:
        names = self.schema.names
        where = f"{self.store.uri(self.ref)} ({self.schema_name})"
        if isinstance(rows, pa.Table):
            missing = [n for n in names if n not in rows.column_names]
            extra = [n for n in rows.column_names if n not in names]
            if missing or extra:
                raise UserError(f"{where}: table columns differ from the schema: missing {missing}, unknown {extra}")
            try:
                return rows.select(names).cast(self.schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise UserError(f"{where}: {exc}") from None
        allowed = set(names)
        for i, row in enumerate(rows):
            unknown = set(row) - allowed
            if unknown:
                raise UserError(
                    f"{where}: row {i} (sample_id {row.get('sample_id')!r}) has unknown fields {sorted(unknown)}"
                )
        try:
            return pa.Table.from_pylist(list(rows), schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise UserError(f"{where}: a row does not fit the schema: {exc}") from None

    def _check_parts_unchanged(self) -> None:
        """Every part the manifest will list still has the bytes this writer recorded (HEAD: size
        and the sha256 put in its metadata), so no overwritten part is ever committed."""
        for part in self._parts:
            head = self.store.head_object(self.ref, part["name"])
            meta = (head or {}).get("Metadata", {}).get("sha256")
            if head is None or head["ContentLength"] != part["bytes"] or (meta and meta != part["sha256"]):
                raise CorruptArtifact(
                    f"{self.store.uri(self.ref, part['name'])} changed after it was committed (another "
                    f"writer?): manifest not written; rerun the stage to resume and re-verify"
                )

    def _write_part(self, table: pa.Table) -> None:
        self.lease.check()
        n = self._next_part
        name = part_name(n)
        sink = pa.BufferOutputStream()
        pq.write_table(
            table.replace_schema_metadata(self.schema.metadata), sink, compression="zstd", row_group_size=ROW_GROUP_ROWS
        )
        data = sink.getvalue().to_pybytes()
        sha = hashlib.sha256(data).hexdigest()
        self.store.write_object(self.ref, name, data, sha256=sha)
        sample_ids = table.column("sample_id").to_pylist()
        record = {
            "part": n,
            "name": name,
            "rows": table.num_rows,
            "bytes": len(data),
            "sha256": sha,
            "fingerprint": self.fingerprint,
            "sample_ids": sample_ids,
            # what the part was made with, for an archive's reuse (storage/archive.py)
            "params": self.params,
            "tokenizer_sha256": self.tokenizer_sha256,
            "template_sha256": self.template_sha256,
        }
        if self.part_summary is not None:
            record["summary"] = self.part_summary(table)
        self._write_progress(record)
        self._records.append(record)
        self._parts.append({"name": name, "rows": table.num_rows, "bytes": len(data), "sha256": sha})
        self._committed_ids.update(sample_ids)
        self._next_part = n + 1
        log.info("%s: committed %s (%d rows)", self.store.uri(self.ref), name, table.num_rows)

    def _write_progress(self, record: dict[str, Any]) -> None:
        name = f"{PROGRESS}/{record['name'][: -len('.parquet')]}.json"
        self.store.write_object(self.ref, name, canonical_json(record).encode(), content_type="application/json")
