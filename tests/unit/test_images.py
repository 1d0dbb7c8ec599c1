"""Image prompts: read once, checked, stored by sha256; placeholders counted as the model's processor does."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import pytest

from eagle3_data.images import ImageSink, expand_media, media_tokens, read_image
from eagle3_data.stages.prompts.load import PromptShape, load_prompts
from tests.fixtures.kimi import VOCAB_SIZE
from tests.image_oracle import image_tokens, processor_ids

SAMPLING = {"temperature": 1.0, "max_tokens": 512}
SIZES = [
    (1, 1),
    (13, 29),
    (28, 28),
    (64, 48),
    (640, 480),
    (1920, 1080),
    (3000, 200),
    (7169, 50),
    (9000, 9000),
    (100, 20000),
]


def png(width: int, height: int, color: tuple = (200, 30, 90)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def test_media_tokens_match_transformers_own_arithmetic():
    assert [media_tokens(w, h) for w, h in SIZES] == [image_tokens(w, h) for w, h in SIZES]


def test_media_tokens_match_vllms_fused_kimi_k25_processor():
    """vLLM's own count (kimi_k25_vision_fused.KimiK25FusedVisionProcessor.media_tokens_calculator,
    in the vLLM venv) with Kimi-K2.5's media_proc_cfg, over real images of each size: what vLLM
    expands a placeholder to must be what our prompt ids hold."""
    import subprocess

    from eagle3_data.stages.hidden_states.vllm_backend import vllm_python

    script = f"""
import json
from PIL import Image
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
cfg = dict(patch_size=14, merge_kernel_size=[2, 2], in_patch_limit=16384, patch_limit_on_one_side=512,
           fixed_output_tokens=None, temporal_merge_kernel_size=4, image_mean=[0.5] * 3, image_std=[0.5] * 3)
proc = KimiK25FusedVisionProcessor(cfg)
sizes = {SIZES[:8]!r}
images = [{{"type": "image", "image": Image.new("RGB", (w, h))}} for w, h in sizes]
print(json.dumps([proc.media_tokens_calculator(image) for image in images]))
"""
    done = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [media_tokens(w, h) for w, h in SIZES[:8]] == json.loads(done.stdout.splitlines()[-1])


def _load(tmp_path: Path, rows: list[dict], store, max_bytes: int = 1 << 20):
    src = tmp_path / "p" / "img.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sink = ImageSink(store, max_bytes)
    return load_prompts(str(src), "img", PromptShape(sampling=SAMPLING), client=store.client, images=sink), sink


def _user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_in_every_source_are_stored_once_by_sha256(tmp_path, store):
    a, b = png(64, 48), png(30, 30, (1, 2, 3))
    (tmp_path / "p" / "pics").mkdir(parents=True)
    (tmp_path / "p" / "pics" / "a.png").write_bytes(a)
    store.client.put_object(Bucket=store.bucket, Key="inputs/b.png", Body=b)
    data_a = "data:image/png;base64," + base64.b64encode(a).decode()
    text = {"type": "text", "text": "what is this?"}
    rows = [
        _user(text, _image("pics/a.png")),
        _user(_image(data_a), text, _image(f"s3://{store.bucket}/inputs/b.png")),
        {"messages": [{"role": "user", "content": "plain text"}]},
    ]
    load, sink = _load(tmp_path, rows, store)
    assert not load.rejects and len(load.rows) == 3
    got = list(load.rows)
    first, second = json.loads(got[0]["images"]), json.loads(got[1]["images"])
    assert got[2]["images"] is None  # a text row is as it always was
    assert first[0] == second[0]  # the same bytes, from a path and a data URI: one object
    for ref, data, (w, h) in [(first[0], a, (64, 48)), (second[1], b, (30, 30))]:
        assert ref["sha256"] == hashlib.sha256(data).hexdigest() and ref["bytes"] == len(data)
        assert (ref["width"], ref["height"], ref["media_tokens"]) == (w, h, media_tokens(w, h))
        assert ref["uri"] == f"s3://{store.bucket}/eagle3-datagen/images/sha256/{ref['sha256']}"
        assert read_image(store, ref) == data
    # the messages name the stored objects, in the order of the references
    parts = [p for p in json.loads(got[1]["messages"])[0]["content"] if p["type"] == "image_url"]
    assert [p["image_url"]["url"] for p in parts] == [r["uri"] for r in second]
    assert sink.counts["images_stored"] == 2
    assert {k: load.counts[k] for k in ("image_rows", "images", "media_tokens")} == {
        "image_rows": 2,
        "images": 3,
        "media_tokens": 2 * media_tokens(64, 48) + media_tokens(30, 30),
    }


def test_broken_missing_and_oversized_images_are_rejects_naming_the_part(tmp_path, store):
    store.client.put_object(Bucket=store.bucket, Key="inputs/ok.png", Body=png(8, 8))
    text = {"type": "text", "text": "look"}
    bad = [
        (_user(text, _image("nowhere.png")), "no such file"),
        (
            _user(text, _image("data:image/png;base64," + base64.b64encode(png(8, 8)[:40]).decode())),
            "not a decodable image",
        ),
        (_user(text, _image("data:image/png;base64,@@@")), "not valid base64"),
        (_user(text, _image(f"s3://{store.bucket}/inputs/missing.png")), "no such object"),
        (
            _user(
                text,
                _image("data:image/png;base64," + base64.b64encode(png(400, 400, (9, 9, 9)) + b"\0" * 5000).decode()),
            ),
            "over the limit",
        ),
        (_user(text, _image("../escape.png")), "may not leave"),
        (
            _user(text, _image("data:image/png;base64," + base64.b64encode(_png_header(10_000, 10_000)).decode())),
            "decompression-bomb",
        ),
    ]
    load, _ = _load(
        tmp_path,
        [r for r, _ in bad] + [_user(text, _image(f"s3://{store.bucket}/inputs/ok.png"))],
        store,
        max_bytes=4000,
    )
    assert len(load.rows) == 1
    assert [r["field"] for r in load.rejects] == ["messages[0].content[1]"] * len(bad)
    assert load.counts["image_rejects"] == len(bad) and load.counts["images"] == 1
    for reject, (_, why) in zip(load.rejects, bad):
        assert why in reject["reason"], reject["reason"]


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels in a few bytes (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def test_image_ids_equal_the_processor_way_of_expanding(kimi_fmt, kimi_tokenizer):
    """Ours: render, encode, expand each pad id. Transformers' processor: expand `<|media_pad|>` in
    the rendered text (Kimi_K25Processor.replace_image_token), then tokenize."""
    sizes = [(640, 480), (13, 29)]
    refs = [{"media_tokens": media_tokens(w, h)} for w, h in sizes]
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare "},
                _image("s3://b/x"),
                {"type": "text", "text": " with "},
                _image("s3://b/y"),
            ],
        },
    ]
    ours = kimi_fmt.generation_prompt_ids(messages, None, refs)
    assert ours == processor_ids(kimi_tokenizer, messages, sizes)
    assert ours.count(kimi_fmt.media_pad_id) == sum(r["media_tokens"] for r in refs)
    with pytest.raises(Exception, match="placeholder"):
        expand_media(ours, refs[:1], kimi_fmt.media_pad_id)


def test_sharegpt_images_fill_the_image_markers_in_order(tmp_path, store):
    (tmp_path / "p").mkdir(parents=True)
    a, b = png(20, 20), png(40, 10, (5, 5, 5))
    (tmp_path / "p" / "a.png").write_bytes(a)
    (tmp_path / "p" / "b.png").write_bytes(b)
    row = {
        "conversations": [
            {"from": "human", "value": "<image>first, then<image>"},
            {"from": "gpt", "value": "ok"},
            {"from": "human", "value": "and?"},
        ],
        "images": ["a.png", "b.png"],
    }
    load, _ = _load(tmp_path, [row, dict(row, images=["a.png"])], store)
    assert [r["field"] for r in load.rejects] == ["conversations[0].value"]
    (got,) = list(load.rows)
    content = json.loads(got["messages"])[0]["content"]
    assert [p["type"] for p in content] == ["image_url", "text", "image_url"] and content[1]["text"] == "first, then"
    assert [r["sha256"] for r in json.loads(got["images"])] == [hashlib.sha256(d).hexdigest() for d in (a, b)]


def test_merge_keeps_media_tokens_untrained_and_the_references_beside_the_shards(store, kimi_fmt):
    import pyarrow.parquet as pq

    from eagle3_data.config import MergeConfig
    from eagle3_data.images import read_merged_images
    from eagle3_data.stages.merge.datasets import merge_datasets
    from eagle3_data.storage import StageRef
    from eagle3_data.storage.writer import StageWriter

    refs = [
        {
            "uri": "s3://b/k",
            "sha256": "0" * 64,
            "bytes": 9,
            "width": 64,
            "height": 48,
            "media_tokens": media_tokens(64, 48),
        }
    ]
    messages = [{"role": "user", "content": [_image("s3://b/k"), {"type": "text", "text": "what?"}]}]
    prompt = kimi_fmt.generation_prompt_ids(messages, None, refs)
    output = kimi_fmt.codec.encode_batch(["a cat"])[0] + kimi_fmt.stop_token_ids[:1]
    base = {
        "dataset": "img",
        "messages": json.dumps(messages),
        "source": "vllm",
        "status": "ok",
        "finish_reason": "stop",
    }
    rows = [
        dict(base, sample_id="with-image", prompt_ids=prompt, output_ids=output, images=json.dumps(refs)),
        dict(
            base,
            sample_id="text",
            prompt_ids=kimi_fmt.generation_prompt_ids([{"role": "user", "content": "hi"}]),
            output_ids=output,
        ),
    ]
    ref = StageRef("date=2026-12-03", "generate_local", "img")
    with StageWriter(store, ref, "generations", rows_per_part=10, tokenizer_sha256="t", template_sha256="c") as w:
        w.write(rows)
        w.commit()
    summary = merge_datasets(store, [ref], "date=2026-12-03", MergeConfig(max_length=4096), vocab_size=VOCAB_SIZE)
    out = StageRef("date=2026-12-03", "merge", "all")
    records = {
        r["sample_id"]: r
        for s in summary["shards"]
        for r in pq.read_table(io.BytesIO(store.read_object(out, s["name"]))).to_pylist()
    }
    rec = records["with-image"]
    pads = [k for k, t in enumerate(rec["input_ids"]) if t == kimi_fmt.media_pad_id]
    assert len(pads) == refs[0]["media_tokens"] and all(rec["loss_mask"][k] == 0 for k in pads)
    assert sum(rec["loss_mask"]) == len(output)
    assert read_merged_images(store, out) == {"with-image": refs}
    assert store.read_manifest(out)["extra"]["images"] == {
        "samples": 1,
        "images": 1,
        "media_tokens": refs[0]["media_tokens"],
    }


def test_overflow_request_sends_each_image_as_a_data_uri_of_the_stored_bytes(tmp_path, store):
    from eagle3_data.stages.generate.checkpoint import parse_prompts
    from eagle3_data.stages.generate.openrouter_rows import RequestShape

    a = png(33, 17)
    (tmp_path / "p").mkdir(parents=True)
    (tmp_path / "p" / "a.png").write_bytes(a)
    load, _ = _load(tmp_path, [_user({"type": "text", "text": "describe"}, _image("a.png"))], store)
    (p,) = list(parse_prompts(list(load.rows), "img", None))
    shape = RequestShape("m", {}, {}, {"temperature": 0.0}, False, lambda ref: read_image(store, ref))
    sent = shape.body(p)["messages"][0]["content"]
    assert sent[0] == {"type": "text", "text": "describe"} and sent[1]["type"] == "image_url"
    header, _, payload = sent[1]["image_url"]["url"].partition(",")
    assert header == "data:image/png;base64" and base64.b64decode(payload) == a
    assert p.messages[0]["content"][1]["image_url"]["url"].startswith("s3://")  # the prompt keeps its reference
    corrupt = dict(p.images[0], sha256="f" * 64)
    with pytest.raises(Exception, match="the reference records"):
        read_image(store, corrupt)


def test_dev_provider_takes_image_parts_as_openrouter_does_and_bills_their_tokens(kimi_tokenizer, kimi_fmt):
    """Billed prompt tokens = the template's render with each image's placeholder counted as
    transformers' processor counts it (the reference, not the code under test); malformed parts
    are the client's 400, naming the part."""
    import asyncio

    import httpx

    from eagle3_data.dev.faults import ServerConfig
    from eagle3_data.dev.inference_server import create_app

    config = ServerConfig()
    app = create_app(kimi_tokenizer, config)

    def chat(content) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dev") as c:
                return await c.post(
                    "/v1/chat/completions",
                    json={"model": config.model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]},
                )

        return asyncio.run(go())

    text = {"type": "text", "text": "what is it?"}
    uri = "data:image/png;base64," + base64.b64encode(png(300, 120)).decode()
    answer = chat([_image(uri), text])
    assert answer.status_code == 200, answer.text
    rendered = kimi_fmt.generation_prompt_ids([{"role": "user", "content": [_image("x"), text]}])
    assert answer.json()["usage"]["prompt_tokens"] == len(rendered) - 1 + image_tokens(300, 120)
    for part, why in [
        ({"type": "image_url", "image_url": "nope"}, "messages[0].content[0].image_url"),
        (_image("data:text/plain;base64,aGk="), "expected data:image"),
        (_image("data:image/png;base64," + base64.b64encode(b"not a png").decode()), "not a readable image"),
    ]:
        refused = chat([part, text])
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text


def test_report_counts_each_datasets_images_media_tokens_and_image_rejects():
    from eagle3_data.report.data import DatasetReport, RunReport
    from eagle3_data.report.render import render_html, render_markdown

    generation = {
        "local": {"ok": 3, "failed": 0, "prompt_tokens": 900, "completion_tokens": 40, "cost_usd": 0.0},
        "images": {"image_rows": 3, "images": 4, "media_tokens": 1234, "image_rejects": 2},
    }
    report = RunReport(
        "r",
        {"created_at": None},
        [
            DatasetReport("img", validation={"samples": 3}, generation=generation),
            DatasetReport("text", validation={"samples": 3}, generation={"local": generation["local"]}),
        ],
    )
    md, html = render_markdown(report), render_html(report, title="t")
    for text in (md, html):
        assert text.count("Image prompts") == 1  # the text-only dataset shows none
    assert "| media tokens (never trained on) | 1,234 |" in md and "| rows refused for an image | 2 |" in md
    assert "<th>images</th><td class='num'>4</td>" in html


def test_sample_image_prompts_are_the_generators_and_load_whole(store, tmp_path):
    """include/sample_data/images.jsonl is what eagle3_devtools.sample_images writes (PNGs made by
    hand with zlib), and every row loads: Pillow decodes each image to the size it was made at."""
    from eagle3_devtools.sample_images import IMAGES, OUT, text

    assert OUT.read_text() == text()
    sink = ImageSink(store, 1 << 20)
    load = load_prompts(str(OUT), "images", PromptShape(sampling=SAMPLING), client=store.client, images=sink)
    assert not load.rejects and load.counts["image_rows"] == load.counts["rows"] == 4
    sizes = {(r["width"], r["height"]) for row in load.rows for r in json.loads(row["images"])}
    assert sizes == {(w, h) for w, h, _ in IMAGES.values()}


def test_the_prompt_token_limit_counts_each_images_media_tokens(tmp_path, store, kimi_fmt):
    from eagle3_data.stages.prompts.load import limit_prompt_tokens

    (tmp_path / "p").mkdir(parents=True)
    (tmp_path / "p" / "big.png").write_bytes(png(640, 480))
    (tmp_path / "p" / "small.png").write_bytes(png(28, 28))
    text = {"type": "text", "text": "what is it?"}
    load, _ = _load(tmp_path, [_user(text, _image("big.png")), _user(text, _image("small.png"))], store)
    limit_prompt_tokens(
        load, 100, lambda messages, tools, images=None: len(kimi_fmt.generation_prompt_ids(messages, tools, images))
    )
    assert [json.loads(r["images"])[0]["width"] for r in load.rows] == [28]  # 1 media token: under the limit
    expected = processor_ids(kimi_fmt.tokenizer, [{"role": "user", "content": [text, _image("x")]}], [(640, 480)])
    assert [r["line"] for r in load.rejects] == [1] and f"{len(expected)} prompt tokens" in load.rejects[0]["reason"]
