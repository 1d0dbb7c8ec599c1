"""`eagle3-data prompts upload | list` against a real S3 (SeaweedFS): a bad row blocks the whole
upload and is named; good files land where a run with that logical date reads them, and the
DAG's loader reads them back from there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from eagle3_data.cli import main
from eagle3_data.config import default_config_raw, load_config
from eagle3_data.stages.prompts.load import PromptShape, load_prompts

SAMPLE = Path(__file__).resolve().parents[2] / "include" / "sample_data"


@pytest.fixture
def env(s3_server, s3_bucket, tmp_path, monkeypatch):
    raw = default_config_raw()
    raw["storage"]["bucket"] = s3_bucket
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("EAGLE3_CONFIG", str(cfg))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    return load_config(cfg)


def _keys(s3, bucket):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_bad_rows_are_named_and_nothing_is_uploaded(env, s3, s3_bucket, tmp_path, capsys):
    good = shutil.copy(SAMPLE / "chat.jsonl", tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "usr", "content": "x"}]})
        + "\n{oops\n"
    )
    assert main(["prompts", "upload", "--dataset", "chat", "--date", "2026-11-02", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad} line 2: messages[0].role" in err and f"{bad} line 3" in err and "nothing uploaded" in err
    assert "Traceback" not in err
    assert _keys(s3, s3_bucket) == []
    assert main(["prompts", "upload", "--dataset", "chat", "--date", "2026-11-02", "--allow-bad-rows", str(bad)]) == 0
    assert len(_keys(s3, s3_bucket)) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "nope", "--date", "2026-11-02"], "not in the config"),
        (["--dataset", "chat", "--date", "2026-11-2"], "expected YYYY-MM-DD"),
    ],
)
def test_bad_arguments(env, argv, message, capsys):
    assert main(["prompts", "upload", *argv, str(SAMPLE / "chat.jsonl")]) == 2
    assert message in capsys.readouterr().err


def test_upload_lands_in_the_date_partition_the_run_reads(env, s3, s3_bucket, capsys):
    for day in ("2026-11-02", "2026-11-03"):
        assert main(["prompts", "upload", "--dataset", "chat", "--date", day, str(SAMPLE / "chat.jsonl")]) == 0
    out = capsys.readouterr().out
    prefix = f"{env.storage.prefix}/prompts/chat"
    assert f"s3://{s3_bucket}/{prefix}/date=2026-11-02/chat.jsonl" in out
    assert _keys(s3, s3_bucket) == [f"{prefix}/date=2026-11-02/chat.jsonl", f"{prefix}/date=2026-11-03/chat.jsonl"]
    chat = next(d for d in env.datasets if d.name == "chat")
    loaded = load_prompts(
        chat.prompts, "chat", PromptShape(sampling=env.generation.sampling.model_dump()), date="2026-11-03", client=s3
    )
    local = load_prompts(str(SAMPLE / "chat.jsonl"), "chat", PromptShape(sampling=env.generation.sampling.model_dump()))
    assert [r["sample_id"] for r in loaded.rows] == [r["sample_id"] for r in local.rows] != []

    assert main(["prompts", "list", "--dataset", "chat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    size = (SAMPLE / "chat.jsonl").stat().st_size
    assert [line.split() for line in lines[1:]] == [["chat", d, "1", str(size)] for d in ("2026-11-02", "2026-11-03")]


def test_image_prompts_are_checked_and_their_image_files_uploaded_beside_them(env, s3, s3_bucket, tmp_path, capsys):
    """A broken image blocks the upload naming the part; the images a prompt names by relative
    path land beside it, where the run's prompts stage reads them (and stores them by sha256)."""
    from eagle3_data.images import ImageSink
    from eagle3_data.storage import ArtifactStore
    from eagle3_devtools.sample_images import IMAGES, png

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "flag.png").write_bytes(png(*IMAGES["flag"]))
    (tmp_path / "pics" / "broken.png").write_bytes(png(*IMAGES["flag"])[:50])
    row = lambda name: {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what flag?"},
                    {"type": "image_url", "image_url": {"url": f"pics/{name}.png"}},
                ],
            }
        ]
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row("broken")) + "\n")
    assert main(["prompts", "upload", "--dataset", "chat", "--date", "2026-11-04", str(bad)]) == 2
    assert f"{bad} line 1: messages[0].content[1]: image: not a decodable image" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(row("flag")) + "\n")
    assert main(["prompts", "upload", "--dataset", "chat", "--date", "2026-11-04", str(good)]) == 0
    prefix = f"{env.storage.prefix}/prompts/chat/date=2026-11-04"
    assert _keys(s3, s3_bucket) == [f"{prefix}/good.jsonl", f"{prefix}/pics/flag.png"]
    chat = next(d for d in env.datasets if d.name == "chat")
    store = ArtifactStore(s3, s3_bucket, prefix="runs-test")
    loaded = load_prompts(
        chat.prompts,
        "chat",
        PromptShape(sampling=env.generation.sampling.model_dump()),
        date="2026-11-04",
        client=s3,
        images=ImageSink(store, env.limits.max_image_bytes),
    )
    (got,) = [json.loads(r["images"]) for r in loaded.rows]
    assert [(r["width"], r["height"]) for r in got] == [IMAGES["flag"][:2]]
