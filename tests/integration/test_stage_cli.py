"""`eagle3-data stage verify|discard` and `eagle3-data s3 init`, in-process against the real SeaweedFS."""

from __future__ import annotations

import uuid

import pytest

from eagle3_data.cli import main
from eagle3_data.storage import ArtifactStore, MissingBucket, StageRef
from eagle3_data.storage.lease import acquire_lease
from eagle3_data.storage.writer import StageWriter

RUN = "date=2026-11-29"


@pytest.fixture(autouse=True)
def s3_env(monkeypatch, s3_server):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)


def _stage(store, stage: str, dataset: str = "chat", inputs=None) -> StageRef:
    ref = StageRef(RUN, stage, dataset)
    with StageWriter(store, ref, "generations", rows_per_part=2, inputs=inputs) as w:
        w.write([{"sample_id": f"{stage}-{i}", "dataset": dataset, "status": "ok"} for i in range(5)])
        w.commit()
    return ref


def _uri(store, ref) -> str:
    return store.uri(ref).rstrip("/")


def test_s3_init_is_the_explicit_step_that_creates_the_bucket(s3, capsys):
    name = f"init-{uuid.uuid4().hex[:12]}"
    store = ArtifactStore(client=s3, bucket=name, prefix="p")
    with pytest.raises(MissingBucket, match=f"bucket '{name}' does not exist.*eagle3-data s3 init --bucket {name}"):
        store.check_bucket()
    with pytest.raises(MissingBucket):  # a write does not create it either
        store.put_json(StageRef(RUN, "x", "y"), "a.json", {})
    assert main(["s3", "init", "--bucket", name]) == 0
    assert capsys.readouterr().out.startswith(f"created: s3://{name}/")
    assert main(["s3", "init", "--bucket", name]) == 0
    assert capsys.readouterr().out.startswith(f"exists: s3://{name}/")
    store.check_bucket()


@pytest.mark.parametrize(
    "write",
    [
        lambda store, ref, path: store.put_json(ref, "a.json", {}),
        lambda store, ref, path: store.put_bytes(ref, "a.md", b"x"),
        lambda store, ref, path: store.put_file(ref, "shard.bin", path),
    ],
    ids=["put_json", "put_bytes", "put_file"],
)
def test_every_side_file_writer_refuses_a_missing_bucket(s3, tmp_path, write):
    """The side-file writers share one path (overwrite check, PUT, record): none creates a bucket."""
    name = f"gone-{uuid.uuid4().hex[:12]}"
    (path := tmp_path / "shard.bin").write_bytes(b"\0" * 64)
    with pytest.raises(MissingBucket, match=f"bucket '{name}' does not exist.*eagle3-data s3 init --bucket {name}"):
        write(ArtifactStore(client=s3, bucket=name, prefix="p"), StageRef(RUN, "x", "y"), path)


def test_stage_verify_passes_a_sound_stage_and_names_a_corrupt_part(store, capsys):
    ref = _stage(store, "generate_local")
    assert main(["stage", "verify", _uri(store, ref)]) == 0
    assert "OK" in capsys.readouterr().out
    key = store.key(ref, "part-00001.parquet")
    body = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    body[30] ^= 0xFF
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))
    assert main(["stage", "verify", _uri(store, ref)]) == 2
    err = capsys.readouterr().err
    assert "BAD" in err and err.strip().splitlines()[-1].count("part-00001.parquet is corrupted") == 1


def test_discard_names_the_stages_it_invalidates_and_cascade_removes_them(store, capsys):
    local = _stage(store, "generate_local")
    validated = _stage(store, "validate", inputs=[local])
    merged = _stage(store, "merge", dataset="all", inputs=[validated])
    other = _stage(store, "generate_local", dataset="other")
    assert main(["stage", "discard", _uri(store, local)]) == 0
    out, err = capsys.readouterr()
    assert f"discarded {store.uri(local)}" in out
    assert "2 downstream stages" in err and store.uri(validated) in err and store.uri(merged) in err
    assert store.uri(other) not in err
    assert not store.is_complete(local) and list(store.objects(local)) == [
        name for name in store.objects(local) if name.endswith("_lease.json")
    ]
    assert store.is_complete(validated) and store.is_complete(merged)
    assert main(["stage", "discard", "--cascade", _uri(store, validated)]) == 0
    assert not store.is_complete(validated) and not store.is_complete(merged) and store.is_complete(other)


def test_discard_refuses_while_a_writer_holds_the_stage(store, capsys):
    ref = _stage(store, "generate_overflow")
    lease = acquire_lease(store, ref, owner="running-task", heartbeat=False)
    try:
        assert main(["stage", "discard", _uri(store, ref)]) == 2
        assert "being written by running-task" in capsys.readouterr().err
        assert store.is_complete(ref)
    finally:
        lease.release()


def test_tokenizer_s3_fetch_uses_the_callers_client(s3, s3_bucket, kimi_tokenizer_dir, tmp_path, monkeypatch):
    """The s3:// tokenizer source goes through the client passed in (Airflow: aws_default's), with
    the store's one-line outage error; the environment's default credentials are never consulted."""
    from pathlib import Path

    from eagle3_data.storage import StorageUnavailable, s3_client
    from eagle3_data.tokenizer import _fetch_s3_prefix

    for path in Path(kimi_tokenizer_dir).iterdir():
        if path.is_file():
            s3.upload_file(str(path), s3_bucket, f"tok/{path.name}")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)  # only the passed client knows the endpoint and keys
    local = _fetch_s3_prefix(f"s3://{s3_bucket}/tok", str(tmp_path / "cache"), s3)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in Path(kimi_tokenizer_dir).iterdir() if p.is_file()
    )
    down = s3_client("http://127.0.0.1:9", access_key="x", secret_key="y", max_attempts=1)
    with pytest.raises(StorageUnavailable, match="unreachable while listing the tokenizer files"):
        _fetch_s3_prefix(f"s3://{s3_bucket}/tok", str(tmp_path / "cache2"), down)
