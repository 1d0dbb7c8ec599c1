"""SGLang 0.5.23's behaviours a client must meet, against the dev server (protocol-true to them):
a full queue is backpressure, a silently truncated prompt is a failed row naming the cut, a
sampling key SGLang's schema lets through but its SamplingParams refuses never reaches it, and a
server started with `--api-key` is sent its key (and the key is written nowhere)."""

from __future__ import annotations

import io
import json
import logging
import math

import httpx
import pytest

from eagle3_data.errors import UserError
from eagle3_data.storage import StageRef
from eagle3_devtools.sample_images import png
from tests.generation_calls import generate_local, image_prompts
from tests.integration.test_generation import SAMPLING, prompts


def test_a_full_queue_is_backpressure_not_a_dead_endpoint(store, start_dev_server, kimi_tokenizer, tmp_path):
    """`--max-queued-requests` answers 503 "The request queue is full.": counted against the
    endpoint, one endpoint allowed one failure would be dropped at the first and the stage stop."""
    server = start_dev_server({"seed": 8, "endpoints": {"generate": {"queue_full": 0.5}}})
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="chat")
    s = generate_local(
        store,
        ref,
        prompts(16, "chat"),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        journal_dir=tmp_path,
        in_flight_per_endpoint=4,
        max_endpoint_failures=1,
        max_attempts=2,
    )
    assert s["complete"] and s["counts"]["ok"] == 16, s
    assert server.stats()["faults"]["generate"]["queue_full"] >= 8  # the queue really was full, often


def test_a_prompt_the_server_truncates_is_a_failed_row_naming_the_cut(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server({"auto_truncate_to": 10})  # --allow-auto-truncate with a short context
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="cut")
    s = generate_local(store, ref, prompts(4, "cut"), kimi_tokenizer, [server.url], SAMPLING, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["failed"] == 4, s  # final: the same server cuts it the same way
    for r in store.read_table(ref).to_pylist():
        assert r["status"] == "failed" and r["output_ids"] is None
        assert (
            f"prompt cut by {server.url}: {len(r['prompt_ids'])} prompt ids sent, meta_info.prompt_tokens = 10"
            in r["error"]
        )


def test_choice_is_refused_before_any_request(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({})
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "choice": ["a", "b"]}}
    assert httpx.post(f"{server.url}/generate", json=body).status_code == 500  # what SGLang does with it
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="choice")
    with pytest.raises(UserError, match="'choice' is not an SGLang sampling parameter"):
        generate_local(
            store,
            ref,
            prompts(2, "chat"),
            kimi_tokenizer,
            [server.url],
            dict(SAMPLING, choice=["a"]),
            journal_dir=tmp_path,
        )
    assert not server.stats()["requests"].get("generate")


PICTURES = [
    [png(64, 48, lambda x, y: (x, y, 9))],
    [png(30, 90, lambda x, y: (y, 3, x)), png(41, 70, lambda x, y: (7, x, y))],
]


def test_image_prompts_go_as_one_pad_per_image_with_image_data(store, start_dev_server, kimi_tokenizer, tmp_path):
    """SGLang's Kimi-K2.5 processor takes exactly one `<|media_pad|>` per `image_data` entry and
    expands it itself (the dev server refuses any other count, as SGLang does): an ok row means
    the ids went collapsed, and its prompt ids are ours, expanded, which the server's counts match."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.chat_format.kimi_k2 import MEDIA_PAD

    server = start_dev_server({})
    rows = image_prompts(store, PICTURES)
    ref = StageRef(run_key="sgl-img", stage="generate_local", dataset="images")
    s = generate_local(store, ref, rows, kimi_tokenizer, [server.url], SAMPLING, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["ok"] == 2, s
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    pad = kimi_tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    for r, row in zip(sorted(store.read_table(ref).to_pylist(), key=lambda r: r["sample_id"]), rows):
        refs = json.loads(row["images"])
        assert r["status"] == "ok" and r["images"] == row["images"]
        # oracle: the template's one pad per image, each repeated by transformers' own count (test_images.py)
        assert r["prompt_ids"] == fmt.generation_prompt_ids(json.loads(row["messages"]), None, refs)
        assert r["prompt_ids"].count(pad) == sum(x["media_tokens"] for x in refs) > len(refs)


def test_an_engine_counting_other_media_tokens_is_a_failed_row_naming_the_counts(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    """A server whose processor gives each image one more token (another processor version): its
    meta_info.prompt_tokens and image_tokens are not ours; the row fails, final, naming both, and
    the first position the ids can part at (SGLang reports counts, not ids)."""
    server = start_dev_server({"media_token_drift": 1})
    rows = image_prompts(store, PICTURES[:1])
    ref = StageRef(run_key="sgl-img", stage="generate_local", dataset="drift")
    s = generate_local(store, ref, rows, kimi_tokenizer, [server.url], SAMPLING, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["failed"] == 1, s
    (r,) = store.read_table(ref).to_pylist()
    n = json.loads(rows[0]["images"])[0]["media_tokens"]
    first = r["prompt_ids"].index(163_605)
    assert r["error"] == (
        f"media tokens: {server.url} ran {len(r['prompt_ids']) + 1} prompt tokens ({n + 1} of them images), "
        f"ours are {len(r['prompt_ids'])} ({n} media tokens for 1 image(s)): its processor counts another number "
        f"of media tokens for an image; the ids part at position {first} (the first image's) or later"
    )
    assert server.stats()["requests"]["generate"] == {"img0000": 1}  # final: not retried


def test_image_answers_are_scored_with_one_pad_per_image_and_their_image_data(start_dev_server):
    """The policy check's SGLang scoring request for an image prompt goes as its generation went:
    one pad per image and `image_data` (the dev server refuses anything else, as SGLang does), with
    `logprob_start_len` counted on the expanded ids (SGLang's `origin_input_ids`): the window is
    exactly the answer. A server whose processor counts another number of media tokens refuses
    the item, naming the counts: scored over its ids alone, nothing would have noticed."""
    import base64

    from eagle3_data.config import PolicyConfig
    from eagle3_data.engines.client import Media
    from eagle3_data.engines.sglang import SGLANG
    from eagle3_data.images import ImageError, media_tokens
    from eagle3_data.nucleus import Item
    from eagle3_data.stages.policy import ScoreEndpoints, ScoreTimings, score_items

    uri = "data:image/png;base64," + base64.b64encode(PICTURES[0][0]).decode()
    n = media_tokens(64, 48)
    ids, answer = [1, 163_602, *[163_605] * n, 163_604, 2, 3], [10, 11, 12]
    item = Item("img", "overflow", "overflow", tuple(ids + answer), len(ids), json.dumps([{"media_tokens": n}]))
    media = Media(163_605, [uri], [n])
    policy, timings = PolicyConfig(top_logprobs=5), ScoreTimings(max_attempts=2)
    for drift in (0, 1):
        server = start_dev_server({"media_token_drift": drift})
        (got,), refused, _ = score_items(
            [item], ScoreEndpoints([server.url], SGLANG, timings), policy, media=lambda _: media
        )
        if drift:
            assert got is None and refused["img"].startswith(
                f"images: ran {len(ids) + len(answer) + 1} prompt tokens ({n + 1} of them images), ours are "
            ), refused
        else:
            assert not refused and len(got) == len(answer)

    def gone(_item):  # the stored image deleted or rewritten since generation (images.read_image)
        raise ImageError("s3://b/images/sha256/ab: 3 bytes with sha256 ..., the reference records 70 bytes")

    (got,), refused, _ = score_items([item], ScoreEndpoints([server.url], SGLANG, timings), policy, media=gone)
    assert got is None and refused == {
        "img": "images: s3://b/images/sha256/ab: 3 bytes with sha256 ..., the reference records 70 bytes"
    }


def test_expanded_pads_with_image_data_are_refused_as_sglang_refuses_them(start_dev_server, kimi_tokenizer):
    """SGLang 0.5.23 (srt/multimodal/processors/kimi_k25.py process_mm_data_async) refuses a pad
    count other than the number of images, with this message: so does the dev server."""
    import base64

    server = start_dev_server({})
    uri = "data:image/png;base64," + base64.b64encode(PICTURES[0][0]).decode()
    body = {"input_ids": [1, 163_605, 163_605, 2], "image_data": [uri], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(f"{server.url}/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Kimi image placeholders must map one-to-one to image data: expected 1, found 2 token(s)"
    )
    one = httpx.post(f"{server.url}/generate", json=dict(body, input_ids=[1, 163_605, 2]))
    assert one.status_code == 200 and one.json()["meta_info"]["image_tokens"] == 6  # 64x48: 6 media tokens


def test_scoring_with_top_logprobs_answers_as_sglang_lists_them(start_dev_server):
    """`top_logprobs_num` K with `return_logprob` (the policy check's scoring request,
    engines/sglang.py `score_request`): `meta_info.input_top_logprobs` lines up with
    `input_token_logprobs` (None at `logprob_start_len`, then K `[logprob, id, text]` a position,
    descending), as SGLang 0.5.23 sends them (scheduler_components/logprob_result_processor.py
    `_process_input_top_logprobs`, tokenizer_manager.py `detokenize_top_logprobs_tokens`); the wire
    reads them, and the nucleus rule finds none of the stand-in's own text outside. A
    `top_logprobs_num` that is no integer is SGLang's schema error."""
    from eagle3_data.engines.sglang import SGLANG
    from eagle3_data.nucleus import Nucleus, outside

    server = start_dev_server({})
    ids, first, k = [163_584, 1000, 2000, 3000, 4000, 5000, 6000], 4, 8
    path, body = SGLANG.score_request(ids, first, "top-k", {}, top=k)
    assert body["top_logprobs_num"] == k and body["logprob_start_len"] == first - 1
    answer = httpx.post(f"{server.url}{path}", json=body).json()
    meta = answer["meta_info"]
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_logprobs"]) == len(ids) - first + 1
    assert meta["input_top_logprobs"][0] is None and len(meta["output_top_logprobs"]) == 1
    for row, (own, token, _) in zip(meta["input_top_logprobs"][1:], meta["input_token_logprobs"][1:]):
        values = [e[0] for e in row]
        assert len(row) == k and values == sorted(values, reverse=True) and sum(map(math.exp, values)) < 1
        assert [own, token] in [e[:2] for e in row]
    scored = SGLANG.score_answer(answer, ids, first, k)
    assert scored.logprobs == [e[0] for e in meta["input_token_logprobs"][1:]] and len(scored.top) == len(ids) - first
    assert not outside(scored.logprobs, scored.top, Nucleus(1.0, 0.95), 163_840).any()
    assert len(SGLANG.score_answer(answer, ids, first).logprobs) == len(ids) - first  # without top: as before
    bad = httpx.post(f"{server.url}{path}", json=dict(body, top_logprobs_num="8"))
    assert bad.status_code == 400
    assert bad.json()["error"] == 'invalid type: string "8", expected a value or an array of values for Int64OrList'


API_KEY = "sk-sglang-7d2e91c4a0b3"


@pytest.fixture(scope="module")
def keyed_server(kimi_tokenizer_dir, tmp_path_factory):
    """A dev server started with `--api-key`, as production SGLang servers may be."""
    from eagle3_data.dev.inference_server import DevServerProcess

    server = DevServerProcess(
        kimi_tokenizer_dir, log_path=tmp_path_factory.mktemp("keyed") / "server.log", api_key=API_KEY
    )
    yield server
    server.stop()


def _written(s3, bucket: str, *folders) -> list[str]:
    """Every artifact the stages wrote, as text: the bucket's objects (tables read as rows) and the
    local files (journals)."""
    import pyarrow.parquet as pq

    texts = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            texts.append(repr(pq.read_table(io.BytesIO(body)).to_pylist()) if obj["Key"].endswith(".parquet") else "")
            texts.append(body.decode("latin-1"))
    texts += [f.read_bytes().decode("latin-1") for folder in folders for f in folder.rglob("*") if f.is_file()]
    return texts


def test_a_server_started_with_an_api_key_is_sent_it_and_the_key_is_written_nowhere(
    store, s3, s3_bucket, keyed_server, kimi_tokenizer, tmp_path, caplog
):
    """Generation (health, model and server info, /generate) and the policy check's scoring send
    `Authorization: Bearer <key>` on every request; the key is in no log line and no artifact."""
    from eagle3_data.engines import wire_for
    from eagle3_data.nucleus import Item
    from eagle3_data.stages.policy import ScoreEndpoints, ScoreTimings, score_items

    caplog.set_level(logging.DEBUG)
    assert httpx.get(f"{keyed_server.url}/server_info").status_code == 401  # the server does want the key
    ref = StageRef(run_key="key", stage="generate_local", dataset="keyed")
    s = generate_local(
        store,
        ref,
        prompts(4, "keyed"),
        kimi_tokenizer,
        [keyed_server.url],
        SAMPLING,
        journal_dir=tmp_path,
        api_key=API_KEY,
    )
    assert s["complete"] and s["counts"]["ok"] == 4, s
    # GET /model_info was let in too (without the key, identify reads no weight version)
    assert store.read_manifest(ref)["extra"]["weight_versions"] == {keyed_server.url: "dev"}
    item = Item("k", "overflow", "overflow", (1, 2, 3, 10, 11, 12), 3)
    (got,), refused, _ = score_items(
        [item], ScoreEndpoints([keyed_server.url], wire_for("sglang", API_KEY), ScoreTimings(max_attempts=1))
    )
    assert not refused and len(got) == 3, refused
    assert caplog.records and not [r for r in caplog.records if API_KEY in r.getMessage()]
    written = _written(s3, s3_bucket, tmp_path)
    assert any("keyed" in t for t in written) and not [t for t in written if API_KEY in t]
