"""ArtifactStore against a real S3 (SeaweedFS): layout, manifests, resume, corruption, safety."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.errors import StageConflict, UserError
from eagle3_data.storage import (
    ArtifactStore,
    CorruptArtifact,
    IncompleteStage,
    StageRef,
    StageWriter,
    StorageUnavailable,
    s3_client,
)

REF = StageRef("date=2026-11-29", "generate_local", "tool_calls")


def rows(start: int, stop: int, tag: str = "a") -> list[dict]:
    return [
        {
            "sample_id": f"s{i:04d}",
            "dataset": "tool_calls",
            "sample_index": i,
            "messages": json.dumps([{"role": "user", "content": f"q{i} {tag}"}]),
            "tools": None,
            "route": "local",
        }
        for i in range(start, stop)
    ]


def write_all(store, ref=REF, n=10, rows_per_part=4, tag="a", **kw) -> dict:
    with StageWriter(store, ref, "prompts", rows_per_part=rows_per_part, **kw) as w:
        w.write(rows(0, n, tag))
        return w.commit()


def keys(store, ref=REF) -> list[str]:
    base = store.key(ref)
    return sorted(o["Key"][len(base) :] for o in store.list_objects(base))


def flip_byte(store, key: str, offset: int = 100) -> None:
    data = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    data[offset] ^= 0xFF
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))


# -- names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("run_key", "../etc"),
        ("dataset", "a/b"),
        ("stage", ""),
        ("dataset", "x\ny"),
        ("run_key", "a..b"),
        ("dataset", "ünï"),
        ("dataset", "-x"),
    ],
)
def test_stage_ref_rejects_unsafe_names(field, value):
    parts = {"run_key": "date=2026-11-29", "stage": "merge", "dataset": "chat"} | {field: value}
    with pytest.raises(UserError, match=field):
        StageRef(**parts)


def test_uri_follows_layout(store):
    assert store.uri(REF) == f"s3://{store.bucket}/eagle3-datagen/runs/date=2026-11-29/generate_local/tool_calls/"


# -- write, manifest, read --------------------------------------------------------------------------
def test_writer_commits_parts_then_manifest_with_hashes(store):
    upstream = StageRef("date=2026-11-29", "load", "tool_calls")
    write_all(store, upstream, n=3)
    manifest = write_all(
        store,
        n=10,
        rows_per_part=4,
        params={"temperature": 1.0},
        inputs=[upstream],
        tokenizer_sha256="t" * 64,
        template_sha256="c" * 64,
    )
    assert keys(store) == [
        "_lease.json",  # released, kept: the next writer takes it over with If-Match
        "_manifest.json",
        "_progress/part-00000.json",
        "_progress/part-00001.json",
        "_progress/part-00002.json",
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert [p["rows"] for p in manifest["parts"]] == [4, 4, 2] and manifest["rows"] == 10
    for part in manifest["parts"]:
        body = store.client.get_object(Bucket=store.bucket, Key=store.key(REF, part["name"]))["Body"].read()
        assert part["bytes"] == len(body) and part["sha256"] == hashlib.sha256(body).hexdigest()
    stored = store.read_manifest(REF)
    assert stored["manifest_sha256"] == manifest["manifest_sha256"]
    assert stored["inputs"] == [
        {"uri": store.uri(upstream), "manifest_sha256": store.read_manifest(upstream)["manifest_sha256"]}
    ]
    assert stored["params"] == {"temperature": 1.0} and stored["schema"] == {"name": "prompts", "version": 3}
    assert (
        stored["code"]["version"] and stored["tokenizer_sha256"] == "t" * 64 and stored["template_sha256"] == "c" * 64
    )
    table = store.read_table(REF)
    assert table.column("sample_id").to_pylist() == [f"s{i:04d}" for i in range(10)]
    assert table.schema.metadata[b"eagle3.schema"] == b"prompts"


def test_reader_refuses_stage_without_manifest(store):
    with StageWriter(store, REF, "prompts", rows_per_part=2) as w:
        w.write(rows(0, 5))
        assert not store.is_complete(REF)
        with pytest.raises(IncompleteStage, match="no _manifest.json: stage not complete"):
            store.read_table(REF)
        with pytest.raises(IncompleteStage):
            store.iter_batches(REF)  # at the call, not at the first batch
        w.commit()
    assert store.is_complete(REF)


def test_iter_batches_streams_row_groups_and_columns(store):
    write_all(store, n=10, rows_per_part=6)
    batches = list(store.iter_batches(REF, columns=["sample_id"], batch_size=4))
    assert [b.num_rows for b in batches] == [4, 2, 4]
    assert batches[0].schema.names == ["sample_id"]


def test_iter_batches_stops_early_and_reports_the_bad_part_in_order(store):
    write_all(store, n=12, rows_per_part=3)
    first = next(iter(store.iter_batches(REF)))  # abandoning the stream leaves nothing running
    assert first.num_rows == 3
    flip_byte(store, store.key(REF, "part-00002.parquet"))
    seen = []
    with pytest.raises(CorruptArtifact, match="part-00002"):
        for batch in store.iter_batches(REF, columns=["sample_id"]):
            seen.extend(batch.column(0).to_pylist())
    assert seen == [f"s{i:04d}" for i in range(6)]  # parts before the bad one, nothing from it


def test_empty_stage_reads_as_empty_table(store):
    with StageWriter(store, REF, "generations") as w:
        w.commit()
    assert store.read_table(REF).num_rows == 0 and store.read_manifest(REF)["parts"] == []


def test_writer_without_commit_is_an_error_and_stays_incomplete(store):
    with pytest.raises(RuntimeError, match="without commit"):
        with StageWriter(store, REF, "prompts") as w:
            w.write(rows(0, 2))
    assert not store.is_complete(REF)


# -- bad rows and schemas ----------------------------------------------------------------------------
def test_unknown_field_in_row_names_it(store):
    bad = rows(0, 2)
    bad[1]["prompt"] = "x"
    with pytest.raises(UserError, match=r"row 1 .*s0001.*\['prompt'\]"):
        with StageWriter(store, REF, "prompts") as w:
            w.write(bad)


def test_reading_newer_or_unknown_schema_fails_clearly(store):
    write_all(store, n=2)
    manifest = store.read_manifest(REF)
    for schema, message in [
        ({"name": "prompts", "version": 99}, "newer than this code"),
        ({"name": "embeddings", "version": 1}, "unknown artifact schema"),
    ]:
        store.write_object(REF, "_manifest.json", json.dumps(manifest | {"schema": schema}).encode())
        with pytest.raises(UserError, match=message):
            store.read_table(REF)


def test_arrow_table_input_is_cast_to_schema(store):
    table = pa.Table.from_pylist([{**r, "source_id": None, "images": None} for r in rows(0, 3)])
    with StageWriter(store, REF, "prompts") as w:
        w.write(table)
        w.commit()
    assert store.read_table(REF).schema.field("sample_index").type == pa.int64()


# -- integrity ----------------------------------------------------------------------------------------
def test_flipped_byte_in_part_is_detected_on_read_and_verify(store):
    write_all(store, n=10, rows_per_part=4)
    store.verify(REF)
    flip_byte(store, store.key(REF, "part-00001.parquet"))
    with pytest.raises(CorruptArtifact, match="part-00001.parquet is corrupted"):
        store.verify(REF)
    with pytest.raises(CorruptArtifact, match="part-00001.parquet"):
        list(store.iter_batches(REF))


def test_missing_part_is_detected(store):
    write_all(store, n=10, rows_per_part=4)
    store.client.delete_object(Bucket=store.bucket, Key=store.key(REF, "part-00002.parquet"))
    with pytest.raises(CorruptArtifact, match="part-00002.parquet is listed in the manifest but missing"):
        store.verify(REF)


# -- reruns and resume ----------------------------------------------------------------------------------
def test_rewrite_after_a_discard_gives_the_same_keys_and_bytes(store):
    first = write_all(store, n=9, rows_per_part=4, params={"p": 1})
    before = keys(store)
    store.delete(REF)
    second = write_all(store, n=9, rows_per_part=4, params={"p": 1})
    assert keys(store) == before
    assert [p["sha256"] for p in first["parts"]] == [p["sha256"] for p in second["parts"]]
    assert first["manifest_sha256"] == second["manifest_sha256"]


def objects_with_etags(store, ref=REF) -> dict[str, str]:
    """(key -> ETag) under the stage, its lease aside: what a refused writer must leave as it was."""
    from eagle3_data.storage.lease import is_lease

    base = store.key(ref)
    return {o["Key"]: o["ETag"] for o in store.list_objects(base) if not is_lease(o["Key"][len(base) :])}


@pytest.mark.parametrize("kw", [{}, {"fresh": True}, {"fresh": True, "archive": True}, {"params": {"other": 1}}])
def test_a_committed_stage_is_never_overwritten(store, kw):
    """Committed means immutable: a writer opened on a complete stage, whatever its params and even
    with `fresh` (an unfinished attempt's discard), is refused before it writes or deletes anything;
    only `reopen` resumes one, and a discard is an explicit act (`store.delete`, `--fresh`)."""
    write_all(store, n=9, rows_per_part=4, tag="old")
    before = objects_with_etags(store)
    with pytest.raises(StageConflict, match="is committed: a committed stage is never overwritten"):
        with StageWriter(store, REF, "prompts", rows_per_part=4, **kw):
            pass
    assert objects_with_etags(store) == before
    assert all("old" in m for m in store.read_table(REF).column("messages").to_pylist())


def test_a_fresh_writer_archives_an_unfinished_attempt_before_dropping_it(store):
    """`fresh` with `archive` (a generation stage a person named in --fresh): the unfinished
    attempt of other params is copied to the archive, with its params, before it is discarded,
    and `archived_tables` gives its parts back for those params only."""
    from eagle3_data.storage.archive import archived_tables

    with pytest.raises(KeyboardInterrupt):
        with StageWriter(store, REF, "prompts", rows_per_part=2, params={"temperature": 1.0}) as w:
            w.write(rows(0, 4))
            raise KeyboardInterrupt
    with StageWriter(store, REF, "prompts", rows_per_part=2, params={"t": 0.5}, fresh=True, archive=True) as w:
        assert w.committed_sample_ids() == set()
        w.commit()
    old = list(archived_tables(store, REF, {"temperature": 1.0}, {"tokenizer_sha256": None}))
    assert sorted(sid for t in old for sid in t.column("sample_id").to_pylist()) == [f"s{i:04d}" for i in range(4)]
    assert list(archived_tables(store, REF, {"t": 0.5}, {})) == []


def test_exception_checkpoints_buffer_and_resume_skips_committed(store):
    with pytest.raises(ZeroDivisionError):
        with StageWriter(store, REF, "prompts", rows_per_part=4) as w:
            w.write(rows(0, 6))  # part 0 committed, 2 rows buffered
            raise ZeroDivisionError("the writer's block fails part-way")
    assert store.committed_sample_ids(REF) == {f"s{i:04d}" for i in range(6)}
    with StageWriter(store, REF, "prompts", rows_per_part=4) as w:
        done = w.committed_sample_ids()
        assert done == {f"s{i:04d}" for i in range(6)}
        w.write([r for r in rows(0, 10, "second") if r["sample_id"] not in done])
        manifest = w.commit()
    ids = store.read_table(REF).column("sample_id").to_pylist()
    assert sorted(ids) == [f"s{i:04d}" for i in range(10)] and len(ids) == len(set(ids))
    assert manifest["extra"]["writer"]["resumed_rows"] == 6


def test_orphan_part_without_progress_record_is_not_counted(store, monkeypatch):
    real = StageWriter._write_progress

    def die_on_part_1(self, record):
        if record["part"] == 1:
            raise KeyboardInterrupt  # the process dies after the upload, before the record
        real(self, record)

    monkeypatch.setattr(StageWriter, "_write_progress", die_on_part_1)
    with pytest.raises(KeyboardInterrupt):
        with StageWriter(store, REF, "prompts", rows_per_part=3) as w:
            w.write(rows(0, 7))
    monkeypatch.setattr(StageWriter, "_write_progress", real)
    assert "part-00001.parquet" in keys(store)
    assert store.committed_sample_ids(REF) == {"s0000", "s0001", "s0002"}
    with StageWriter(store, REF, "prompts", rows_per_part=3) as w:
        assert "part-00001.parquet" not in keys(store)  # orphan removed on resume
        w.write([r for r in rows(0, 7) if r["sample_id"] not in w.committed_sample_ids()])
        manifest = w.commit()
    assert manifest["extra"]["writer"]["orphan_parts_removed"] == 1
    ids = store.read_table(REF).column("sample_id").to_pylist()
    assert sorted(ids) == [f"s{i:04d}" for i in range(7)] and len(ids) == 7


def test_duplicate_sample_ids_are_skipped_and_counted(store):
    with StageWriter(store, REF, "prompts", rows_per_part=3) as w:
        w.write(rows(0, 4))
        assert w.write(rows(2, 6)) == 2
        manifest = w.commit()
    assert manifest["rows"] == 6 and manifest["extra"]["writer"]["duplicates_skipped"] == 2


def test_resume_with_different_params_is_refused_unless_fresh(store):
    with pytest.raises(KeyboardInterrupt):
        with StageWriter(store, REF, "prompts", rows_per_part=2, params={"temperature": 1.0}) as w:
            w.write(rows(0, 4))
            raise KeyboardInterrupt
    before = objects_with_etags(store)
    with pytest.raises(StageConflict, match="other params") as refused:
        with StageWriter(store, REF, "prompts", rows_per_part=2, params={"temperature": 0.5}) as w:
            pass
    assert objects_with_etags(store) == before  # refused before any write
    assert "--fresh generate_local" in str(refused.value) and "fresh=True" not in str(refused.value)
    with StageWriter(store, REF, "prompts", rows_per_part=2, params={"temperature": 0.5}, fresh=True) as w:
        assert w.committed_sample_ids() == set()
        w.commit()
    assert store.read_manifest(REF)["rows"] == 0


def test_input_must_be_complete(store):
    with pytest.raises(IncompleteStage, match="stage not complete"):
        StageWriter(store, REF, "prompts", inputs=[StageRef("date=2026-11-29", "load", "tool_calls")])


# -- side files and file stages --------------------------------------------------------------------------
def test_json_side_files_and_manifest_coverage(store):
    store.put_json(REF, "report.json", {"exact": 10})
    with StageWriter(store, REF, "prompts") as w:
        w.write(rows(0, 2))
        manifest = w.commit(files=["report.json"])
    assert store.get_json(REF, "report.json") == {"exact": 10}
    assert [f["name"] for f in manifest["files"]] == ["report.json"]
    store.put_json(REF, "report.json", {"exact": 11})  # overwriting a covered file invalidates
    assert not store.is_complete(REF)


def test_put_file_multipart_roundtrip_and_commit_files(s3, s3_bucket, tmp_path):
    store = ArtifactStore(s3, s3_bucket, multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    ref = StageRef("run-1", "extract_hidden_states", "chat")
    shard = tmp_path / "shard-00000.safetensors"
    shard.write_bytes(os.urandom(11 * 2**20))
    store.put_file(ref, shard.name, shard)
    head = store.client.head_object(Bucket=s3_bucket, Key=store.key(ref, shard.name))
    assert head["ETag"].strip('"').endswith("-3")  # 3 multipart chunks
    assert store.committed_files(ref) == {shard.name}
    manifest = store.commit_files(ref, [shard.name], params={"layers": [2, 4, 6]})
    assert manifest["files"][0]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    store.verify(ref)
    out = store.get_file(ref, shard.name, tmp_path / "back.safetensors", sha256=manifest["files"][0]["sha256"])
    assert out.read_bytes() == shard.read_bytes()
    # the caller's manifest names other bytes (the file was uploaded again since): refused, nothing downloaded
    with pytest.raises(IncompleteStage, match="differs from the manifest that lists it"):
        store.get_file(ref, shard.name, tmp_path / "stale.safetensors", sha256="0" * 64)
    assert not (tmp_path / "stale.safetensors").exists()
    flip_byte(store, store.key(ref, shard.name), offset=7)
    with pytest.raises(CorruptArtifact, match=shard.name):
        store.get_file(ref, shard.name, tmp_path / "again.safetensors")
    with pytest.raises(IncompleteStage, match="never uploaded"):
        store.commit_files(ref, ["shard-00001.safetensors"])


def test_datasets_lists_complete_stages_only(store):
    write_all(store, StageRef("r1", "merge", "chat"), n=2)
    write_all(store, StageRef("r1", "merge", "code"), n=2)
    with pytest.raises(KeyboardInterrupt):
        with StageWriter(store, StageRef("r1", "merge", "tools"), "prompts", rows_per_part=1) as w:
            w.write(rows(0, 2))
            raise KeyboardInterrupt
    assert store.datasets("r1", "merge") == ["chat", "code"]


# -- safety and failures ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params", [{"openrouter": {"api_key": "sk-or-123"}}, {"aws_secret_access_key": "x"}, {"auth": [{"password": "p"}]}]
)
def test_credential_params_are_refused(store, params):
    with pytest.raises(UserError, match="looks like a credential"):
        write_all(store, n=1, params=params)


def test_ordinary_params_that_mention_keys_pass(store):
    params = {"api_key_env": "OPENROUTER_API_KEY", "max_tokens": 512, "bos_token": "[BOS]", "tokenizer_sha256": "t"}
    assert write_all(store, n=1, params=params)["params"] == params


def test_secret_never_in_manifest_or_logs(store, s3_server, caplog):
    caplog.set_level(logging.DEBUG)
    write_all(store, n=5, rows_per_part=2, params={"endpoint": s3_server.endpoint_url})
    store.read_table(REF)
    manifest_text = store.read_object(REF, "_manifest.json").decode()
    assert s3_server.secret_key not in manifest_text
    assert s3_server.secret_key not in caplog.text and s3_server.secret_key not in repr(s3_server)
    assert "committed" in caplog.text  # the logs were captured


def test_wrong_keys_are_refused(s3_server, s3_bucket):
    bad = ArtifactStore(
        s3_client(s3_server.endpoint_url, access_key=s3_server.access_key, secret_key="wrong-secret"), s3_bucket
    )
    with pytest.raises(StorageUnavailable, match="refused the credentials"):
        bad.is_complete(REF)


def test_unreachable_s3_retries_then_clear_error(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    store = ArtifactStore(
        s3_client(f"http://127.0.0.1:{port}", access_key="k", secret_key="s", max_attempts=3, connect_timeout=1), "b"
    )
    caplog.set_level(logging.DEBUG, logger="botocore.retries")
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match=rf"127.0.0.1:{port} unreachable .*after 3 attempts"):
        store.read_manifest(REF)
    assert time.monotonic() - start < 60  # gave up instead of hanging
    assert caplog.text.count("Retry needed") == 2  # 3 attempts = 2 retries with backoff


def test_a_prompts_stage_of_the_older_schema_still_reads():
    """Schema v2 of `prompts` added the rows' own ids; stages committed as v1 (before it) are read
    with the v1 columns, so a run made before the change is still reused, not refused."""
    import io

    from eagle3_data.schemas import schema_for
    from eagle3_data.storage.parts import check_part_schema

    v1, v2 = schema_for("prompts", 1), schema_for("prompts", 2)
    assert v2.names == [*v1.names, "source_id"] and v1.metadata[b"eagle3.schema_version"] == b"1"
    sink = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist(
            [{"sample_id": "s", "dataset": "d", "sample_index": 0, "messages": "[]", "tools": None, "route": "local"}],
            schema=v1,
        ),
        sink,
    )
    assert check_part_schema(io.BytesIO(sink.getvalue()), v1, "old part").metadata is not None
    with pytest.raises(CorruptArtifact, match="'source_id' is missing"):
        check_part_schema(io.BytesIO(sink.getvalue()), v2, "old part")
