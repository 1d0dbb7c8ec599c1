"""Paid answers outlive the stage that held them: a generation stage replaced on purpose (`--fresh`,
the DAG's `fresh_stages`) is moved here first, and a later run of the same stage takes back every
answer whose sample and settings still match instead of asking (and paying) again.

Layout, beside `runs/` (so nothing that lists a run's stages sees it):
    {prefix}/archive/{run_key}/{stage}/{dataset}/{UTC stamp}/
        part-*.parquet, _progress/*    the stage's objects, copied server-side
        _archived.json                 where it came from, why, its params and tokenizer hashes,
                                       and the parts that may be reused (name, bytes, sha256)

An archived part is reused only when its params and tokenizer/template hashes equal the new
stage's (the sample id already binds the prompt and the sampling); its bytes are checked against
the recorded sha256 before a row of it is trusted.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.canonical import canonical_json
from eagle3_data.storage.lease import is_lease
from eagle3_data.storage.refs import StageRef

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

log = logging.getLogger(__name__)

ARCHIVE = "archive"
RECORD = "_archived.json"
# the stages whose rows were paid for: archived, never dropped, whenever they are discarded
PAID_STAGES = ("generate_local", "generate_overflow")


def archive_base(store: ArtifactStore, ref: StageRef) -> str:
    """The key prefix under which `ref`'s archived attempts lie, one folder per archiving."""
    base = f"{ARCHIVE}/{ref.run_key}/{ref.stage}/{ref.dataset}/"
    return f"{store.prefix}/{base}" if store.prefix else base


def archive_stage(store: ArtifactStore, ref: StageRef, reason: str) -> str | None:
    """Copy every object of `ref` (leases aside) under a new archive folder, then its record, last
    (a folder without one is an interrupted copy, ignored). Returns the folder's URI; None when
    the stage holds no part. The stage itself is left as it was: the caller deletes it."""
    objects = {name: o for name, o in store.objects(ref).items() if not is_lease(name)}
    manifest = store.read_manifest(ref) if store.is_complete(ref) else None
    if manifest is not None:
        parts = [{k: p[k] for k in ("name", "bytes", "sha256")} for p in manifest.get("parts", [])]
        params, hashes = manifest.get("params"), manifest
    else:  # an unfinished attempt: its progress records say what it was made with
        records = [r for r in store.progress_records(ref) if objects.get(r["name"], {}).get("Size") == r["bytes"]]
        parts = [{k: r[k] for k in ("name", "bytes", "sha256")} for r in records]
        first = records[0] if records else {}
        params, hashes = first.get("params"), first
    if not parts:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    folder = f"{archive_base(store, ref)}{stamp}/"
    for name in objects:
        store.client.copy(
            {"Bucket": store.bucket, "Key": store.key(ref, name)}, store.bucket, folder + name, Config=store.transfer
        )
    record = {
        "from": store.uri(ref),
        "archived_at": stamp,
        "reason": reason,
        "complete": manifest is not None,
        "params": params,
        "tokenizer_sha256": hashes.get("tokenizer_sha256"),
        "template_sha256": hashes.get("template_sha256"),
        "parts": parts,
    }
    store.put_object(folder + RECORD, canonical_json(record).encode(), content_type="application/json")
    uri = f"s3://{store.bucket}/{folder}"
    log.warning("%s: %d parts archived to %s (%s)", store.uri(ref), len(parts), uri, reason)
    return uri


def archived_tables(
    store: ArtifactStore, ref: StageRef, params: Mapping[str, Any], hashes: Mapping[str, str | None]
) -> Iterator[pa.Table]:
    """The parts archived from `ref` that were made with these `params` and tokenizer `hashes`,
    oldest archiving first, each verified against its recorded sha256 (a changed one is skipped
    with a warning: its samples are asked again)."""
    base = archive_base(store, ref)
    records = sorted(o["Key"] for o in store.list_objects(base) if o["Key"].endswith("/" + RECORD))
    want = canonical_json(params)
    for key in records:
        record = json.loads(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        if canonical_json(record.get("params")) != want or any(
            record.get(name) != value for name, value in hashes.items()
        ):
            continue
        folder = key[: -len(RECORD)]
        for part in record["parts"]:
            data = store.client.get_object(Bucket=store.bucket, Key=folder + part["name"])["Body"].read()
            if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                log.warning(
                    "s3://%s/%s%s changed since it was archived: not reused", store.bucket, folder, part["name"]
                )
                continue
            yield pq.read_table(io.BytesIO(data))


def discard_stages(store: ArtifactStore, targets: list[StageRef], reason: str) -> list[str]:
    """Delete each stage of `targets` (manifest first), the paid ones archived first: every lease
    is taken before anything is touched, so a running writer on any of them refuses the whole
    discard (StageBusy) and nothing changes. Returns the archive folders' URIs."""
    import contextlib

    archived = []
    with contextlib.ExitStack() as leases:
        for target in targets:
            leases.enter_context(store.lease(target))
        for target in targets:
            if target.stage in PAID_STAGES and (uri := archive_stage(store, target, reason)) is not None:
                archived.append(uri)
            store.delete(target)
    return archived
