"""`eagle3-data merge` and `eagle3-data extract` against a real S3 (SeaweedFS), with resume by shard,
on the packaged default's target (the tiny Kimi-K2.5, `tiny_kimi_k25_dir`)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_data.cli import main
from eagle3_data.config import HiddenStatesConfig
from eagle3_data.errors import UserError
from eagle3_data.exports.shards import ShardReader
from eagle3_data.runs.upstream import merged_shards
from eagle3_data.stages.hidden_states.backends import TransformersBackend
from eagle3_data.stages.hidden_states.extract import commit_extraction, extract_shard
from eagle3_data.storage import IncompleteStage, StageRef
from tests.fixtures.kimi import VOCAB_SIZE
from tests.unit.test_merge import gen_row, write_stage

RUN = "date=2026-11-29"


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)


@pytest.fixture
def generations(store):
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, 163_584, (n,), generator=g).tolist()

    refs = [StageRef(RUN, "generate_local", "chat"), StageRef(RUN, "reconstruct", "tools")]
    write_stage(
        store, refs[0], [gen_row(f"c{i}", "chat", "sglang", ids(6 + i), ids(10 + 2 * i) + [163586]) for i in range(12)]
    )
    write_stage(
        store, refs[1], [gen_row(f"t{i}", "tools", "openrouter", ids(20), ids(5 + i) + [163586]) for i in range(8)]
    )
    return refs


def test_merge_and_extract_cli_against_s3(store, generations, tiny_kimi_k25_dir, s3_env, tmp_path, capsys):
    uri = lambda ref: store.uri(ref)
    merge_ref = StageRef(RUN, "merge", "all")
    out_ref = StageRef(RUN, "hidden_states", "all")  # the run's hidden-states stage, the DAG's
    assert (
        main(
            [
                "merge",
                *[arg for r in generations for arg in ("--input", uri(r))],
                "--out-run-key",
                RUN,
                "--shard-tokens",
                "150",
                "--max-length",
                "40",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    shards = merged_shards(store, merge_ref)
    assert len(shards) > 1
    assert (
        main(
            [
                "extract",
                "--model",
                str(tiny_kimi_k25_dir),
                "--input",
                uri(merge_ref),
                "--last-hidden",
                "--shard-tokens",
                "100",
            ]
        )
        == 0
    )
    manifest = store.read_manifest(out_ref)
    extra = manifest["extra"]
    assert extra["layer_ids"] == [1, 3, 4] and extra["convention"] == "output"
    assert (extra["dtype"], extra["compute_dtype"]) == ("bfloat16", "float32")  # stored bf16, computed fp32 on CPU
    assert extra["totals"]["samples"] == 20
    assert manifest["inputs"][0]["uri"] == uri(merge_ref)
    # the stored shard of one sample matches its merged record; no padding stored
    names = [f["name"] for f in manifest["files"] if f["name"].endswith(".safetensors")]
    samples = {}
    for name in names:
        for s in ShardReader(store.get_file(out_ref, name, tmp_path / name)):
            samples[s.sample_id] = s
    assert sum(len(s.input_ids) for s in samples.values()) == extra["totals"]["tokens"]
    assert all(s.aux_hidden_states.shape == (len(s.input_ids), 192) for s in samples.values())
    assert all(
        s.input_ids[s.loss_mask.bool()].tolist()[-1] == 163586
        for s in samples.values()
        if int(s.loss_mask.sum()) and len(s.input_ids) < 40
    )
    capsys.readouterr()
    # rerun: every shard is skipped, the manifest is rewritten with the same content
    assert (
        main(
            [
                "extract",
                "--model",
                str(tiny_kimi_k25_dir),
                "--input",
                uri(merge_ref),
                "--last-hidden",
                "--shard-tokens",
                "100",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("(already done)") == len(shards)
    assert main(["export-specforge", "--input", uri(out_ref), "--out", str(tmp_path / "sf")]) == 0
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == 20


def test_the_default_extraction_exports_to_both_trainers_with_the_draft_vocabulary(
    store, generations, tiny_kimi_k25_dir, s3_env, tmp_path, capsys
):
    """One extraction feeds every trainer: the config's defaults (last state before the norm),
    exported both ways from S3, each with the merge's draft vocabulary where its trainer looks."""
    run = "both-trainers"
    uri = lambda ref: store.uri(ref)
    assert (
        main(
            [
                "merge",
                *[arg for r in generations for arg in ("--input", uri(r))],
                "--out-run-key",
                run,
                "--max-length",
                "40",
            ]
        )
        == 0
    )
    assert main(["extract", "--model", str(tiny_kimi_k25_dir), "--input", uri(StageRef(run, "merge", "all"))]) == 0
    hs = uri(StageRef(run, "hidden_states", "all"))
    extra = store.read_manifest(StageRef(run, "hidden_states", "all"))["extra"]
    assert (extra["last_hidden"], extra["last_hidden_norm"]) == (True, "pre")
    vocab = store.read_manifest(StageRef(run, "merge", "all"))["extra"]["draft_vocab"]
    n = vocab["size"]
    assert 0 < vocab["coverage"] <= 1 and vocab["trained_tokens"] > 0
    capsys.readouterr()
    assert main(["export-specforge", "--input", hs, "--out", str(tmp_path / "sf")]) == 0
    assert f"draft vocabulary: vocab_mapping-{n}.pt" in capsys.readouterr().out
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == 20 and (tmp_path / "sf" / f"vocab_mapping-{n}.pt").exists()
    assert main(["export-speculators", "--input", hs, "--out", str(tmp_path / "spec"), "--fp8"]) == 0
    assert len(list((tmp_path / "spec" / "hidden_states").glob("hs_*.safetensors"))) == 20
    assert {p.name for p in (tmp_path / "spec").iterdir()} >= {"token_freq.pt", f"d2t-{n}.npy", f"t2d-{n}.npy"}
    # online training: the merged ids alone, no states
    merge_uri = uri(StageRef(run, "merge", "all"))
    assert main(["export-speculators", "--ids-only", "--input", merge_uri, "--out", str(tmp_path / "spec-ids")]) == 0
    assert not (tmp_path / "spec-ids" / "hidden_states").exists() and (tmp_path / "spec-ids" / "token_freq.pt").exists()
    assert main(["export-specforge", "--ids-only", "--input", merge_uri, "--out", str(tmp_path / "sf-ids")]) == 0
    lines = (tmp_path / "sf-ids" / "prompts.jsonl").read_text().splitlines()
    assert len(lines) == 20 and set(json.loads(lines[0])) == {"input_ids", "loss_mask", "sample_id"}
    assert main(["export-specforge", "--ids-only", "--input", hs, "--out", str(tmp_path / "x")]) == 2  # not a merge


def test_extract_shard_resumes_by_shard_and_commit_waits_for_all(store, generations, tiny_kimi_k25_dir, tmp_path):
    from eagle3_data.config import MergeConfig
    from eagle3_data.stages.merge.datasets import merge_datasets

    summary = merge_datasets(store, generations, RUN, MergeConfig(shard_tokens=200), vocab_size=VOCAB_SIZE)
    merge_ref = StageRef(**summary["ref"])
    out_ref = StageRef(RUN, "extract_hidden_states", "all")
    first, *rest = summary["shards"]
    done = extract_shard(store, first, tiny_kimi_k25_dir, out_ref)
    assert done["samples"] == first["samples"] and "skipped" not in done
    with pytest.raises(IncompleteStage, match="not extracted yet"):
        commit_extraction(store, merge_ref, out_ref)
    again = extract_shard(store, first, tiny_kimi_k25_dir, out_ref)
    assert again["skipped"] and again["files"] == done["files"]
    for shard in rest:
        extract_shard(store, shard, tiny_kimi_k25_dir, out_ref)
    result = commit_extraction(store, merge_ref, out_ref, params={"convention": "output"})
    assert result["totals"]["samples"] == 20
    assert json.dumps(store.read_manifest(out_ref)["params"]) == '{"convention": "output"}'
    # shards stored in different dtypes cannot make one stage
    mixed_ref = StageRef(RUN, "extract_hidden_states", "mixed")
    backend = TransformersBackend(tiny_kimi_k25_dir)
    for i, shard in enumerate(summary["shards"]):
        extract_shard(
            store,
            shard,
            tiny_kimi_k25_dir,
            mixed_ref,
            HiddenStatesConfig(storage_dtype="fp32" if i == 0 else "bf16"),
            backend=backend,
        )
    with pytest.raises(UserError, match="different \\['aux_encoding', 'dtype'\\]"):
        commit_extraction(store, merge_ref, mixed_ref)


class TakesImages:
    """The transformers backend made to look started "for images": records each sample's image
    bytes, then runs the text forward (that backend gets no pixels: transformers' Kimi-K2.5 image
    processor needs torchvision, absent here; tests/engine's Kimi-K2.5 test feeds real pixels
    through vLLM)."""

    max_images = 1

    def __init__(self, inner):
        self.inner, self.seen = inner, {}
        self.final_norm, self.lm_head = inner.final_norm, inner.lm_head

    def describe(self):
        return self.inner.describe()

    def forward(self, batch, indices, last_hidden, images=None):
        for ids, imgs in zip(batch, images or [()] * len(batch), strict=True):
            self.seen[tuple(ids)] = list(imgs)
        return self.inner.forward(batch, indices, last_hidden)


def test_exports_of_image_samples_from_s3(store, tiny_kimi_k25_dir, s3_env, tmp_path, capsys):
    """Image samples through `merge`, `extract` and every export from S3. Extraction feeds each
    image sample its stored, hash-checked bytes when the backend was started for images, and
    otherwise leaves it out, counted (never states over the ids alone). SpecForge's offline
    format leaves them out and the command names how many (left_out.jsonl: which and why); the
    ids-only exports and speculators' index carry their references (the merge's images.jsonl)."""
    from eagle3_data.images import NO_IMAGES_IN_FORMAT, ImageSink
    from eagle3_devtools.sample_images import png

    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, 163_584, (n,), generator=g).tolist()
    sink = ImageSink(store, max_bytes=1 << 20)
    pictures = {f"c{i}": png(28, 28, lambda x, y, i=i: (40 * i, x, y)) for i in (1, 3)}
    refs = {sid: [sink._store(data)] for sid, data in pictures.items()}
    rows = [
        {**gen_row(f"c{i}", "chat", "sglang", ids(6), ids(8) + [163586]), "images": json.dumps(refs.get(f"c{i}"))}
        if f"c{i}" in refs
        else gen_row(f"c{i}", "chat", "sglang", ids(6), ids(8) + [163586])
        for i in range(6)
    ]
    write_stage(store, StageRef(RUN, "generate_local", "chat"), rows)
    run, uri = "images", lambda ref: store.uri(ref)
    assert main(["merge", "--input", uri(StageRef(RUN, "generate_local", "chat")), "--out-run-key", run]) == 0
    merge_ref, out_ref = StageRef(run, "merge", "all"), StageRef(run, "hidden_states", "all")
    # a text-only backend (hidden_states.max_images 0) leaves the image samples out and counts them
    text_ref = StageRef(run, "hidden_states", "text-only")
    for shard in merged_shards(store, merge_ref):
        extract_shard(store, shard, tiny_kimi_k25_dir, text_ref)
    text_only = commit_extraction(store, merge_ref, text_ref)["totals"]
    assert (text_only["samples"], text_only["left_out_image_samples"]) == (4, 2)
    # a backend started for images gets every image sample's stored bytes, in prompt order
    backend = TakesImages(TransformersBackend(tiny_kimi_k25_dir))
    for shard in merged_shards(store, merge_ref):
        extract_shard(store, shard, tiny_kimi_k25_dir, out_ref, backend=backend)
    assert commit_extraction(store, merge_ref, out_ref)["totals"]["samples"] == 6
    by_id = {tuple(r["prompt_ids"] + r["output_ids"]): r["sample_id"] for r in rows}
    assert {by_id[k]: v for k, v in backend.seen.items() if v} == {sid: [data] for sid, data in pictures.items()}
    # a stored image that no longer matches its reference is an error naming the sample
    store.put_object(refs["c1"][0]["uri"].split("/", 3)[3], b"not the same bytes")
    with pytest.raises(UserError, match="sample c1: field 'images': .*the reference records"):
        extract_shard(
            store,
            merged_shards(store, merge_ref)[0],
            tiny_kimi_k25_dir,
            StageRef(run, "hidden_states", "again"),
            backend=TakesImages(TransformersBackend(tiny_kimi_k25_dir)),
        )
    capsys.readouterr()
    assert (
        main(["export-specforge", "--input", uri(StageRef(run, "hidden_states", "all")), "--out", str(tmp_path / "sf")])
        == 0
    )
    assert "2 image samples left out" in capsys.readouterr().out
    left = [json.loads(line) for line in (tmp_path / "sf" / "left_out.jsonl").read_text().splitlines()]
    assert sorted(e["sample_id"] for e in left) == ["c1", "c3"] and {e["reason"] for e in left} == {NO_IMAGES_IN_FORMAT}
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == 4
    merge_uri = uri(StageRef(run, "merge", "all"))
    assert (
        main(
            [
                "export-speculators",
                "--input",
                uri(StageRef(run, "hidden_states", "all")),
                "--out",
                str(tmp_path / "spec"),
            ]
        )
        == 0
    )
    assert main(["export-specforge", "--ids-only", "--input", merge_uri, "--out", str(tmp_path / "sf-ids")]) == 0
    for path in (tmp_path / "spec" / "index.jsonl", tmp_path / "sf-ids" / "prompts.jsonl"):
        got = {e["sample_id"]: e.get("images") for e in map(json.loads, path.read_text().splitlines())}
        assert got == {f"c{i}": refs.get(f"c{i}") for i in range(6)}, path
