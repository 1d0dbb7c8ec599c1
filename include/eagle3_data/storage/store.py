"""`ArtifactStore`: stage outputs in S3 as Parquet parts plus a manifest written last.

Layout under `s3://{bucket}/{prefix}/runs/{run_key}/{stage}/{dataset}/`:
    part-00000.parquet ...        rows, one part per checkpoint
    <name>                        side files (reports, hidden-state shards)
    _progress/part-00000.json     written after its part: the part's sha256 and sample_ids
    _progress/files/<name>.json   written after its file: size and sha256
    _manifest.json                written last; its presence is what "complete" means

Readers trust the manifest, never listings; the listing is used only by a resuming writer.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

import eagle3_data
from eagle3_data.canonical import canonical_json  # re-exported: the one JSON spelling hashed and stored
from eagle3_data.errors import UserError
from eagle3_data.forksafe import PerProcess
from eagle3_data.schemas import schema_for
from eagle3_data.storage.client import NO_BUCKET, NOT_FOUND, endpoint_of, error_code, fork_safe, s3_errors
from eagle3_data.storage.parts import PROGRESS, check_part_schema
from eagle3_data.storage.refs import (
    CorruptArtifact,
    IncompleteStage,
    MissingBucket,
    StageRef,
    check_file_name,
    check_name,
    part_number,
)

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
MANIFEST_FORMAT = "eagle3-datagen/manifest"
MANIFEST_VERSION = 1
_CHUNK = 8 * 1024 * 1024
_SECRET_KEY = re.compile(r"(secret|secret_key|password|passwd|api_?key|access_key(_id)?|credentials?|authorization)$")


def file_sha256(path: Path) -> str:
    """A local file's sha256, read in chunks (shards are gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_hash(manifest: dict[str, Any]) -> str:
    """Content hash of a manifest, blind to when it was written: reruns of equal content match."""
    body = {k: v for k, v in manifest.items() if k not in ("created_at", "manifest_sha256")}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


@lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """eagle3_data version plus the git commit of the source tree when there is one."""
    sha = os.environ.get("EAGLE3_GIT_SHA")
    if not sha:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(eagle3_data.__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            )
            sha = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            sha = None
    return {"version": eagle3_data.__version__, "git_sha": sha}


def check_no_secrets(obj: Any, where: str) -> None:
    """Refuse credential-looking keys in params: manifests are read by everyone with bucket access."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if _SECRET_KEY.search(str(key).lower().replace("-", "_")):
                raise UserError(f"{where}: key {key!r} looks like a credential; secrets never go into manifests")
            check_no_secrets(value, where)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            check_no_secrets(value, where)


@dataclass(frozen=True)
class StageOrigin:
    """What a stage was made from, as its manifest records it: its inputs (`input_records`), the
    params that decided it and the tokenizer it was rendered with."""

    inputs: list[dict]
    params: dict | None = None
    tokenizer_sha256: str | None = None
    template_sha256: str | None = None


class _Prefetch:
    """Downloads the next part on a worker thread while the caller reads the current one.

    A reader suspended across a fork (a generator the child resumes) finds no thread in the
    child: it fetches again what the parent had submitted, on a pool of its own."""

    def __init__(self, fetch) -> None:
        self._fetch = fetch
        self._pool = PerProcess(
            lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch"),
            discard=lambda pool: pool.shutdown(wait=False, cancel_futures=True),
        )
        self._pending = None  # (part, future of this process)

    def submit(self, part: dict[str, Any]) -> None:
        self._pending = (part, self._pool.get().submit(self._fetch, part))

    def take(self):
        part, future = self._pending
        self._pending = None
        if self._pool.inherited():  # forked since submit: the future's thread is the parent's
            self._pool.reset()
            future = self._pool.get().submit(self._fetch, part)
        return future.result()

    def close(self) -> None:
        if self._pending is not None and not self._pool.inherited():
            _, future = self._pending
            if not future.cancel():
                future.add_done_callback(lambda fut: fut.exception() is None and fut.result().close())
        self._pending = None
        self._pool.reset()


class ArtifactStore:
    """Stage artifacts on any S3 endpoint through a boto3 client the caller owns."""

    def __init__(
        self,
        client,
        bucket: str,
        prefix: str = "eagle3-datagen",
        *,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 64 * 1024 * 1024,
        max_concurrency: int = 8,
        stand_ins: Iterable[str] = (),
    ) -> None:
        self.client = fork_safe(client)
        # what the run that writes through this store ran on instead of the real thing (a dev
        # config's `stand_ins`): named in every manifest it writes, so it travels with the data
        self.stand_ins = tuple(stand_ins)
        self.bucket = bucket
        segments = [p for p in prefix.strip("/").split("/") if p]
        self.prefix = "/".join(check_name(p, "prefix segment") for p in segments)
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )

    # -- names -------------------------------------------------------------------------------
    def key(self, ref: StageRef, name: str = "") -> str:
        base = f"{self.prefix}/{ref.path}" if self.prefix else ref.path
        return f"{base}/{name}"

    def uri(self, ref: StageRef, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(ref, name)}"

    # -- bucket and low-level objects ----------------------------------------------------------
    def bucket_exists(self) -> bool:
        with s3_errors(self.client, f"checking bucket {self.bucket}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
                return True
            except ClientError as exc:
                if error_code(exc) not in NOT_FOUND | {NO_BUCKET}:
                    raise
                return False

    def check_bucket(self) -> None:
        """A missing bucket is a setup step not done, never something a task creates on its own."""
        if not self.bucket_exists():
            raise self._missing_bucket()

    def _missing_bucket(self) -> MissingBucket:
        return MissingBucket(
            f"bucket {self.bucket!r} does not exist at {endpoint_of(self.client)}: create it once with "
            f"`eagle3-data s3 init --bucket {self.bucket}` (or your infrastructure's tooling)"
        )

    def init_bucket(self) -> bool:
        """Create the bucket (the explicit setup step `eagle3-data s3 init`); False if it existed."""
        if self.bucket_exists():
            return False
        with s3_errors(self.client, f"creating bucket {self.bucket}"):
            self.client.create_bucket(Bucket=self.bucket)
        log.info("created bucket %s", self.bucket)
        return True

    def lease(self, ref: StageRef, ttl_s: float | None = None, *, scope: str | None = None):
        """The stage's write lease (one writer per stage), for stages written without `writer()`
        (file stages): `with store.lease(ref): ...`. `scope` leases one unit of the stage instead
        (a hidden-state shard), so parallel workers on different units do not block each other.
        StageBusy names the holder."""
        from eagle3_data.storage.lease import DEFAULT_TTL_S, acquire_lease

        return acquire_lease(self, ref, ttl_s=ttl_s or DEFAULT_TTL_S, scope=scope)

    def _put(
        self, key: str, body: bytes | Path, *, sha256: str | None = None, content_type: str = "application/octet-stream"
    ) -> None:
        """The one writer of an object: `body` in memory (one PUT, multipart above the threshold)
        or a local file (streamed, multipart above the threshold), its sha256 in its metadata when
        given. Every public writer below comes here, so retries, multipart and the missing
        bucket's message are the same for all of them."""
        extra: dict[str, Any] = {"ContentType": content_type}
        if sha256:
            extra["Metadata"] = {"sha256": sha256}
        what = f"uploading {body} to" if isinstance(body, Path) else "writing"
        with s3_errors(self.client, f"{what} s3://{self.bucket}/{key}"):
            try:
                if isinstance(body, Path):
                    self.client.upload_file(str(body), self.bucket, key, ExtraArgs=extra, Config=self.transfer)
                elif len(body) >= self.transfer.multipart_threshold:
                    self.client.upload_fileobj(
                        io.BytesIO(body), self.bucket, key, ExtraArgs=extra, Config=self.transfer
                    )
                else:
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
            except ClientError as exc:
                self._raise_if_no_bucket(exc)
                raise

    def _get_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        with s3_errors(self.client, f"reading s3://{self.bucket}/{key}"):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except ClientError as exc:
                if error_code(exc) in NOT_FOUND:
                    return None
                self._raise_if_no_bucket(exc)
                raise

    def _raise_if_no_bucket(self, exc: ClientError) -> None:
        if error_code(exc) == NO_BUCKET:
            raise self._missing_bucket() from None

    def _exists(self, key: str) -> dict[str, Any] | None:
        with s3_errors(self.client, f"checking s3://{self.bucket}/{key}"):
            try:
                return self.client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if error_code(exc) in NOT_FOUND:
                    if not self.bucket_exists():  # HEAD has no body: a 404 may be the bucket
                        self.check_bucket()
                    return None
                raise

    def _delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        with s3_errors(self.client, f"deleting under s3://{self.bucket}/"):
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        with s3_errors(self.client, f"listing s3://{self.bucket}/{prefix}"):
            try:
                for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                    out.extend(page.get("Contents", []))
            except ClientError as exc:
                self._raise_if_no_bucket(exc)
                raise
        return out

    def put_object(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """One object at a bucket-relative key (not under `prefix`): inputs such as prompt files,
        whose layout the config names (`{prompts_root}/{dataset}/date=D/`). Returns its URI."""
        self._put(key, data, sha256=hashlib.sha256(data).hexdigest(), content_type=content_type)
        return f"s3://{self.bucket}/{key}"

    def list_objects(self, prefix: str) -> list[dict[str, Any]]:
        """Objects under a bucket-relative key prefix (dicts with Key, Size, ETag, LastModified)."""
        return self._list(prefix)

    def _download(
        self, key: str, expected_sha256: str | None, expected_bytes: int | None, label: str
    ) -> tempfile.SpooledTemporaryFile[bytes]:
        """Stream an object into a spooled temp file (RAM up to 64 MiB, then disk), hashing as it
        comes, and refuse it before anyone parses it if it is missing or its bytes changed."""
        out = tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024)  # noqa: SIM115 (returned open)
        digest = hashlib.sha256()
        size = 0
        try:
            with s3_errors(self.client, f"reading {label}"):
                try:
                    body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
                except ClientError as exc:
                    self._raise_if_no_bucket(exc)
                    if error_code(exc) in NOT_FOUND:
                        raise CorruptArtifact(
                            f"{label} is listed in the manifest but missing from S3: rerun the stage"
                        ) from None
                    raise
                for chunk in iter(lambda: body.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        except BaseException:
            out.close()  # a read that failed part-way must not leave the spilled file behind
            raise
        if (expected_bytes is not None and size != expected_bytes) or (
            expected_sha256 and digest.hexdigest() != expected_sha256
        ):
            out.close()
            raise CorruptArtifact(
                f"{label} is corrupted: {size} bytes with sha256 {digest.hexdigest()[:16]}..., the manifest "
                f"says {expected_bytes} bytes with sha256 {(expected_sha256 or '?')[:16]}...: rerun the stage"
            )
        out.seek(0)
        return out

    # -- a stage's objects: the public layer the writer, leases, checkpoints and the CLI use --------
    def objects(self, ref: StageRef, under: str = "") -> dict[str, dict[str, Any]]:
        """The stage's objects (only those under `under`, a name prefix such as "_progress/") by
        name relative to the stage: {name: {"Key", "Size", "ETag", "LastModified"}}."""
        base = self.key(ref)
        return {o["Key"][len(base) :]: o for o in self._list(base + under)}

    def read_object(self, ref: StageRef, name: str) -> bytes | None:
        """The bytes of one object of the stage, or None when it does not exist."""
        return self._get_bytes(self.key(ref, name))

    def write_object(
        self,
        ref: StageRef,
        name: str,
        data: bytes,
        *,
        sha256: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> None:
        """One object of the stage (a part, a progress record), its sha256 in its metadata when
        given. No file record: side files go through `put_bytes` / `put_json` / `put_file`."""
        self._put(self.key(ref, name), data, sha256=sha256, content_type=content_type)

    def head_object(self, ref: StageRef, name: str) -> dict[str, Any] | None:
        """HEAD of one object of the stage (size, metadata), or None when it does not exist."""
        return self._exists(self.key(ref, name))

    def delete_objects(self, ref: StageRef, names: Iterable[str]) -> None:
        self._delete(self.key(ref, name) for name in names)

    def open_verified(self, ref: StageRef, name: str, *, sha256: str | None, nbytes: int | None):
        """One object streamed into a spooled temp file, refused (CorruptArtifact) before anyone
        parses it when it is missing or its size or sha256 differ from what a record says."""
        return self._download(self.key(ref, name), sha256, nbytes, self.uri(ref, name))

    def progress_records(self, ref: StageRef) -> list[dict[str, Any]]:
        """The progress records of a stage's parts (`_progress/part-N.json`), by part number."""
        records = []
        for rel, obj in self.objects(ref, f"{PROGRESS}/").items():
            stem = rel[len(PROGRESS) + 1 :]
            if "/" in stem or not stem.endswith(".json") or part_number(stem[: -len(".json")] + ".parquet") is None:
                continue
            data = self._get_bytes(obj["Key"])
            if data is not None:
                try:
                    records.append(json.loads(data))
                except ValueError:
                    log.warning(
                        "%s: unreadable progress record, ignored (its part is produced again)", self.uri(ref, rel)
                    )
        return sorted(records, key=lambda r: r["part"])

    # -- manifests -------------------------------------------------------------------------------
    def is_complete(self, ref: StageRef) -> bool:
        return self._exists(self.key(ref, MANIFEST)) is not None

    def read_manifest(self, ref: StageRef) -> dict[str, Any]:
        data = self._get_bytes(self.key(ref, MANIFEST))
        if data is None:
            raise IncompleteStage(
                f"{self.uri(ref)} has no {MANIFEST}: stage not complete (still running, killed, or "
                f"invalidated by a rerun); run stage {ref.stage!r} for dataset {ref.dataset!r} first"
            )
        try:
            manifest = json.loads(data)
        except ValueError:
            raise CorruptArtifact(f"{self.uri(ref, MANIFEST)} is not valid JSON") from None
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("manifest_version", 0) > MANIFEST_VERSION:
            raise CorruptArtifact(
                f"{self.uri(ref, MANIFEST)}: unsupported manifest format {manifest.get('format')!r} "
                f"version {manifest.get('manifest_version')!r} (this code reads {MANIFEST_FORMAT} v{MANIFEST_VERSION})"
            )
        return manifest

    def invalidate(self, ref: StageRef) -> bool:
        """Delete the manifest: readers now refuse the stage until it is committed again."""
        if not self.is_complete(ref):
            return False
        self._delete([self.key(ref, MANIFEST)])
        log.info("invalidated %s (manifest removed before rewrite)", self.uri(ref))
        return True

    def delete(self, ref: StageRef) -> None:
        """Remove a stage entirely, manifest first so no reader sees a half-deleted stage (the
        lease object stays: take it with `lease(ref)` around this to keep writers out)."""
        self.invalidate(ref)
        base = self.key(ref)
        from eagle3_data.storage.lease import is_lease

        objects = [o["Key"] for o in self._list(base) if not is_lease(o["Key"][len(base) :])]
        self._delete(sorted(objects, key=lambda k: not k.startswith(base + PROGRESS)))

    def input_record(self, ref: StageRef) -> dict[str, Any]:
        """How a downstream manifest names an upstream stage: URI plus its manifest's hash."""
        manifest = self.read_manifest(ref)
        return {"uri": self.uri(ref), "manifest_sha256": manifest.get("manifest_sha256") or manifest_hash(manifest)}

    def input_records(self, inputs: Iterable[StageRef | dict[str, Any]] | None) -> list[dict[str, Any]]:
        records = []
        for item in inputs or []:
            if isinstance(item, StageRef):
                records.append(self.input_record(item))
            elif isinstance(item, dict) and "uri" in item:
                records.append(dict(item))
            else:
                raise TypeError(f"inputs: expected StageRef or {{'uri': ..., ...}}, got {item!r}")
        check_no_secrets(records, "inputs")
        return records

    def write_manifest(
        self,
        ref: StageRef,
        *,
        schema: dict | None,
        parts: list[dict],
        files: list[dict],
        origin: StageOrigin,
        extra: dict | None,
    ) -> dict:
        """Write the stage's manifest, the object whose presence means "complete": write it last,
        after every part and file it lists. Refuses credential-looking keys in `origin.params` and
        `extra`."""
        params = origin.params
        check_no_secrets(params or {}, "params")
        check_no_secrets(extra or {}, "extra")
        manifest = {
            "format": MANIFEST_FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "uri": self.uri(ref),
            "run_key": ref.run_key,
            "stage": ref.stage,
            "dataset": ref.dataset,
            "schema": schema,
            "rows": sum(p["rows"] for p in parts),
            "parts": parts,
            "files": files,
            "inputs": origin.inputs,
            "params": params or {},
            "code": code_version(),
            "tokenizer_sha256": origin.tokenizer_sha256,
            "template_sha256": origin.template_sha256,
            "extra": extra or {},
        }
        if self.stand_ins:
            manifest["stand_ins"] = list(self.stand_ins)
        manifest["manifest_sha256"] = manifest_hash(manifest)
        manifest["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        body = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False).encode()
        self.write_object(ref, MANIFEST, body, content_type="application/json")
        log.info("committed %s: %d rows in %d parts, %d files", self.uri(ref), manifest["rows"], len(parts), len(files))
        return manifest

    # -- parquet stages (written by storage.writer.StageWriter) ---------------------------------
    def _checked_manifest(self, ref: StageRef) -> dict[str, Any]:
        manifest = self.read_manifest(ref)
        schema = manifest.get("schema")
        if not schema:
            raise UserError(
                f"{self.uri(ref)} holds files, not Parquet parts ({[f['name'] for f in manifest.get('files', [])]})"
            )
        try:
            schema_for(schema["name"], schema["version"])
        except UserError as exc:
            raise UserError(f"{self.uri(ref)}: {exc}") from None
        return manifest

    def iter_batches(
        self, ref: StageRef, columns: list[str] | None = None, batch_size: int = 1024
    ) -> Iterator[pa.RecordBatch]:
        """Stream the stage's rows, part by part, each part's sha256 checked before it is parsed."""
        manifest = self._checked_manifest(ref)  # refuses now, not at first next()
        schema = schema_for(manifest["schema"]["name"], manifest["schema"]["version"])
        return self._batches(ref, manifest["parts"], columns, batch_size, schema)

    def _batches(
        self,
        ref: StageRef,
        parts: list[dict[str, Any]],
        columns: list[str] | None,
        batch_size: int,
        schema: pa.Schema | None = None,
    ) -> Iterator[pa.RecordBatch]:
        def fetch(part: dict[str, Any]):
            return self._download(
                self.key(ref, part["name"]), part["sha256"], part["bytes"], self.uri(ref, part["name"])
            )

        # one part downloads (and is hashed) while the caller consumes the previous one: two parts in memory at most
        ahead = _Prefetch(fetch)
        try:
            if parts:
                ahead.submit(parts[0])
            for i in range(len(parts)):
                with ahead.take() as f:
                    if i + 1 < len(parts):
                        ahead.submit(parts[i + 1])
                    label = self.uri(ref, parts[i]["name"])
                    pf = check_part_schema(f, schema, label) if schema is not None else pq.ParquetFile(f)
                    try:
                        yield from pf.iter_batches(batch_size=batch_size, columns=columns)
                    except (OSError, pa.ArrowException) as exc:
                        raise CorruptArtifact(f"{label}: unreadable ({str(exc).splitlines()[0][:120]})") from None
        finally:  # the caller stopped early or a part was bad: drop the prefetched part
            ahead.close()

    def read_table(self, ref: StageRef, columns: list[str] | None = None) -> pa.Table:
        """The whole stage in memory: for small artifacts (reports, rejects, prompt sets)."""
        manifest = self._checked_manifest(ref)
        schema = schema_for(manifest["schema"]["name"], manifest["schema"]["version"])
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
        batches = list(self.iter_batches(ref, columns=columns))
        return pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()

    def verify(self, ref: StageRef) -> None:
        """Download and hash every part and file of the manifest, and check each part's columns
        against the manifest's schema version; CorruptArtifact names the first bad one."""
        problems = self.check(ref)
        if problems:
            raise CorruptArtifact(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))

    def check(self, ref: StageRef) -> list[str]:
        """Every problem of a complete stage, one line each naming the part or file (empty: sound)."""
        manifest = self.read_manifest(ref)
        schema = None
        if manifest.get("schema"):
            schema = schema_for(manifest["schema"]["name"], manifest["schema"]["version"])
        problems = []
        for kind, items in (("part", manifest.get("parts", [])), ("file", manifest.get("files", []))):
            for item in items:
                label = self.uri(ref, item["name"])
                try:
                    with self._download(self.key(ref, item["name"]), item["sha256"], item["bytes"], label) as f:
                        if kind == "part" and schema is not None:
                            check_part_schema(f, schema, label)
                except CorruptArtifact as exc:
                    problems.append(str(exc))
        return problems

    def quick_check(self, ref: StageRef, manifest: dict[str, Any] | None = None) -> list[str]:
        """A complete stage's cheap re-verification before it is reused: one LIST of the stage (no
        download) says whether every part and file the manifest names is still there with the
        recorded size and unchanged since the manifest was written (Last-Modified no later than the
        manifest's: parts are written before their manifest, and any rewrite of a part after the
        commit gives it a later one). One line per problem, naming the part; empty: sound. A
        same-size rewrite within the manifest's second escapes it: `verify` (sha256) is the full check."""
        manifest = manifest if manifest is not None else self.read_manifest(ref)
        base = self.key(ref)
        objects = {o["Key"][len(base) :]: o for o in self._list(base)}
        committed = objects.get(MANIFEST, {}).get("LastModified")
        problems = []
        for item in [*manifest.get("parts", []), *manifest.get("files", [])]:
            label, obj = self.uri(ref, item["name"]), objects.get(item["name"])
            if obj is None:
                problems.append(f"{label} is listed in the manifest but missing from S3")
            elif obj["Size"] != item["bytes"]:
                problems.append(f"{label} has {obj['Size']} bytes, the manifest says {item['bytes']}")
            elif committed is not None and obj["LastModified"] > committed:
                problems.append(
                    f"{label} was rewritten at {obj['LastModified'].isoformat(timespec='seconds')}, "
                    f"after the manifest ({committed.isoformat(timespec='seconds')})"
                )
        return problems

    def stages(self, run_key: str) -> list[StageRef]:
        """Every complete stage of a run (any stage, any dataset)."""
        check_name(run_key, "run_key")
        base = f"{self.prefix}/runs/{run_key}/" if self.prefix else f"runs/{run_key}/"
        refs = []
        for obj in self._list(base):
            rel = obj["Key"][len(base) :].split("/")
            if len(rel) == 3 and rel[2] == MANIFEST:
                refs.append(StageRef(run_key, rel[0], rel[1]))
        return sorted(refs)

    def downstream(self, ref: StageRef) -> list[StageRef]:
        """Complete stages of the same run whose manifests name `ref` as an input, transitively:
        what a discard of `ref` leaves pointing at data that no longer exists."""
        inputs = {}
        for other in self.stages(ref.run_key):
            if other != ref:
                inputs[other] = {i.get("uri") for i in self.read_manifest(other).get("inputs", [])}
        found: list[StageRef] = []
        frontier = [self.uri(ref)]
        while frontier:
            uri = frontier.pop()
            for other, uris in inputs.items():
                if uri in uris and other not in found:
                    found.append(other)
                    frontier.append(self.uri(other))
        return sorted(found)

    def committed_sample_ids(self, ref: StageRef) -> set[str]:
        """sample_ids in the committed parts of a stage, complete or not (resume and routing use it)."""
        return {sid for record in self.progress_records(ref) for sid in record["sample_ids"]}

    def datasets(self, run_key: str, stage: str) -> list[str]:
        """Dataset names with a complete manifest for this stage in this run."""
        check_name(run_key, "run_key")
        check_name(stage, "stage")
        names = self._children(f"{self.prefix}/runs/{run_key}/{stage}/" if self.prefix else f"runs/{run_key}/{stage}/")
        return [n for n in names if self.is_complete(StageRef(run_key, stage, n))]

    def run_keys(self) -> list[str]:
        """Every run key with something stored under it, complete or not."""
        return self._children(f"{self.prefix}/runs/" if self.prefix else "runs/")

    def committed_at(self, ref: StageRef) -> datetime | None:
        """When the stage's manifest was written; None while the stage is incomplete."""
        head = self._exists(self.key(ref, MANIFEST))
        return None if head is None else head["LastModified"]

    def _children(self, base: str) -> list[str]:
        """The names one level below `base` (a prefix ending in "/"), sorted."""
        names = set()
        with s3_errors(self.client, f"listing s3://{self.bucket}/{base}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"
            ):
                names.update(p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted(names)

    # -- side files and file stages -------------------------------------------------------------------
    def _file_record_key(self, ref: StageRef, name: str) -> str:
        return self.key(ref, f"{PROGRESS}/files/{name}.json")

    def _before_overwrite(self, ref: StageRef, name: str) -> None:
        """Overwriting something a manifest lists invalidates that manifest first."""
        manifest = self._get_bytes(self.key(ref, MANIFEST))
        if manifest is not None and name in {f["name"] for f in json.loads(manifest).get("files", [])}:
            self.invalidate(ref)

    def _put_side_file(
        self,
        ref: StageRef,
        name: str,
        body: bytes | Path,
        size: int,
        sha256: str,
        content_type: str = "application/octet-stream",
    ) -> str:
        """A side file: a manifest listing the old one invalidated first, then the object, then its
        record (`_progress/files/<name>.json`), which marks it committed for `committed_files`."""
        check_file_name(name)
        self._before_overwrite(ref, name)
        self._put(self.key(ref, name), body, sha256=sha256, content_type=content_type)
        record = {"name": name, "bytes": size, "sha256": sha256}
        self._put(self._file_record_key(ref, name), canonical_json(record).encode(), content_type="application/json")
        return self.uri(ref, name)

    def put_json(self, ref: StageRef, name: str, obj: Any) -> str:
        """A JSON side file (failures.json, reports)."""
        data = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode()
        return self.put_bytes(ref, name, data, content_type="application/json")

    def put_bytes(self, ref: StageRef, name: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """A small side file such as report.md."""
        return self._put_side_file(ref, name, data, len(data), hashlib.sha256(data).hexdigest(), content_type)

    def get_json(self, ref: StageRef, name: str) -> Any:
        return json.loads(self.get_bytes(ref, name))

    def get_bytes(self, ref: StageRef, name: str) -> bytes:
        check_file_name(name)
        data = self._get_bytes(self.key(ref, name))
        if data is None:
            raise IncompleteStage(f"{self.uri(ref, name)} does not exist")
        return data

    def put_file(self, ref: StageRef, name: str, local_path: str | os.PathLike[str]) -> str:
        """Upload a large local file (multipart above the threshold) with its sha256; a record
        written after the upload marks it committed for `committed_files`."""
        check_file_name(name)
        path = Path(local_path)
        size = path.stat().st_size
        uri = self._put_side_file(ref, name, path, size, file_sha256(path))
        log.info("uploaded %s (%d bytes)", uri, size)
        return uri

    def get_file(
        self, ref: StageRef, name: str, local_path: str | os.PathLike[str], *, sha256: str | None = None
    ) -> Path:
        """Download (parallel ranged GETs above the threshold) and check the sha256 recorded at upload.
        `sha256`: the one the caller's manifest lists; a file uploaded since with other bytes (the
        stage is being rewritten) raises IncompleteStage before the download."""
        check_file_name(name)
        path = Path(local_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = self._get_bytes(self._file_record_key(ref, name))
        if record is None:
            raise IncompleteStage(f"{self.uri(ref, name)} was never uploaded through the store (no record)")
        expected = json.loads(record)
        if sha256 is not None and expected["sha256"] != sha256:
            raise IncompleteStage(
                f"{self.uri(ref, name)} differs from the manifest that lists it (the stage is "
                f"being rewritten): retry once it is committed"
            )
        with s3_errors(self.client, f"downloading {self.uri(ref, name)}"):
            try:
                self.client.download_file(self.bucket, self.key(ref, name), str(path), Config=self.transfer)
            except ClientError as exc:
                if error_code(exc) in NOT_FOUND:
                    raise CorruptArtifact(
                        f"{self.uri(ref, name)} is recorded as uploaded but missing from S3"
                    ) from None
                raise
        if file_sha256(path) != expected["sha256"]:
            path.unlink()
            raise CorruptArtifact(
                f"{self.uri(ref, name)} is corrupted: its sha256 differs from the one recorded at upload"
            )
        return path

    def committed_files(self, ref: StageRef) -> set[str]:
        """Names of side files fully uploaded (their record exists); resume-by-shard skips these."""
        base = self.key(ref, f"{PROGRESS}/files/")
        return {o["Key"][len(base) : -len(".json")] for o in self._list(base) if o["Key"].endswith(".json")}

    def commit_files(
        self,
        ref: StageRef,
        names: Iterable[str],
        *,
        params: dict[str, Any] | None = None,
        inputs: Iterable[StageRef | dict[str, Any]] | None = None,
        tokenizer_sha256: str | None = None,
        template_sha256: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Manifest for a stage whose outputs are files (hidden-state shards): written last."""
        return self.write_manifest(
            ref,
            schema=None,
            parts=[],
            files=self.file_entries(ref, names),
            origin=StageOrigin(self.input_records(inputs), params, tokenizer_sha256, template_sha256),
            extra=extra,
        )

    def file_entries(self, ref: StageRef, names: Iterable[str]) -> list[dict[str, Any]]:
        entries = []
        for name in sorted(set(names)):
            check_file_name(name)
            data = self._get_bytes(self._file_record_key(ref, name))
            if data is None:
                raise IncompleteStage(
                    f"{self.uri(ref, name)} was never uploaded through the store (no record): cannot commit it"
                )
            entries.append(json.loads(data))
        return entries
