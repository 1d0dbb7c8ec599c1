"""Extraction with images on the tiny Kimi-K2.5 (vLLM CPU) against transformers' own forward.

The engines are the session's own (tests/fixtures/engine.py: `vllm_backend` and `vllm_server`
run `dev:tiny-kimi-k25` with images enabled for every engine test). The pixels of the reference are
vLLM's own Kimi-K2.5 image processor's (`KimiK25FusedVisionProcessor`, run alone in the vLLM
venv): transformers' Kimi-K2.5 image processor imports torchvision, which has no CPU build here.
The reference is `Kimi_K25ForConditionalGeneration.model(input_ids, pixel_values,
image_grid_thw, output_hidden_states=True)` on one sample at a time: nothing shared with the engine.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_data.stages.hidden_states.vllm_backend import PromptIdsDiffer
from eagle3_data.target_head.final_norm import rms_norm
from tests.image_oracle import vllm_pixels

INDICES = [2, 4, 5]
REL = 1e-5  # measured: vLLM 2.6e-6 (image samples) and 3.9e-7 (text), transformers backend 3.3e-7
MEDIA = {"begin": 163_602, "content": 163_603, "pad": 163_605, "end": 163_604}


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of seeded random RGB pixels, encoded with the standard library (the pipeline's venv has
    no PIL; the engine's image reader decodes it)."""
    import struct
    import zlib

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width * 3), generator=g, dtype=torch.uint8)
    raw = b"".join(b"\x00" + bytes(row.tolist()) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


IMAGES = {"a": png(90, 60, 0), "b": png(41, 70, 1)}
# the processor test's sizes beyond IMAGES: a wide image and one scaled down to `in_patch_limit` patches
SIZES = {"a": (90, 60), "b": (41, 70), "wide": (1000, 30), "large": (2100, 1600)}
EVERY_IMAGE = {**IMAGES, "wide": png(*SIZES["wide"], 2), "large": png(*SIZES["large"], 3)}


@pytest.fixture(scope="module")
def every_pixels(vllm_python, tiny_kimi_k25_dir, tmp_path_factory) -> dict:
    """name -> (pixel_values [N, 3, 14, 14], grid_thw [1, 3]) of EVERY_IMAGE from vLLM's own Kimi
    image processor: one run of it (a process of the vLLM venv) for the whole module."""
    return vllm_pixels(vllm_python, tiny_kimi_k25_dir, EVERY_IMAGE, tmp_path_factory.mktemp("pixels"))


@pytest.fixture(scope="module")
def pixels(every_pixels) -> dict:
    """IMAGES' pixels from vLLM's own Kimi image processor."""
    return {name: every_pixels[name] for name in IMAGES}


def media_tokens(grid_thw: torch.Tensor) -> int:
    """MoonViT merges 2x2 patches into one token (transformers' get_image_features split sizes)."""
    return int(grid_thw[0, 1:].prod()) // 4


def prompt(tokenizer, parts: list, pixels: dict) -> list[int]:
    """A user turn of text and images (K2.5's media wrapper, pads expanded), then the assistant's start."""

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    ids = (
        [tokenizer.convert_tokens_to_ids("<|im_user|>")]
        + enc("user")
        + [tokenizer.convert_tokens_to_ids("<|im_middle|>")]
    )
    for part in parts:
        if part in IMAGES:
            n = media_tokens(pixels[part][1])
            ids += [MEDIA["begin"]] + enc("image") + [MEDIA["content"]] + [MEDIA["pad"]] * n + [MEDIA["end"]]
        else:
            ids += enc(part)
    return (
        ids
        + [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_assistant|>")]
        + enc("assistant")
        + [tokenizer.convert_tokens_to_ids("<|im_middle|>")]
    )


@pytest.fixture(scope="module")
def reference(tiny_kimi_k25_dir):
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_k25_dir), dtype=torch.float32).eval()


def reference_states(model, ids, images, pixels):
    kwargs = {}
    if images:
        kwargs = {
            "pixel_values": torch.cat([pixels[n][0] for n in images]).float(),
            "image_grid_thw": torch.cat([pixels[n][1] for n in images]),
        }
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids]), output_hidden_states=True, **kwargs).hidden_states


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


SAMPLES = [["Describe ", "a", " in one word."], ["b", "Compare with ", "a"], ["No image here."]]


def test_the_transformers_backends_pixels_are_vllms_processors(tiny_kimi_k25_dir, every_pixels):
    """pixels.py (the transformers backend's preprocessing: transformers' own processor needs
    torchvision) gives vLLM's processor's pixel values and grid, value for value, for small
    images, a wide one and one scaled down to `in_patch_limit` patches; the grid's 2x2-merged
    count is the media-token count our prompt ids were expanded with."""
    from eagle3_data.images import media_tokens
    from eagle3_data.stages.hidden_states.pixels import KimiPixels

    theirs = every_pixels
    ours = KimiPixels.from_model_dir(tiny_kimi_k25_dir)
    assert ours.size(*SIZES["large"]) < SIZES["large"]  # scaled down: more patches than in_patch_limit
    assert set(theirs) == set(EVERY_IMAGE)
    for name, data in EVERY_IMAGE.items():
        values, grid = ours(data)
        assert torch.equal(grid, theirs[name][1]), name
        assert values.dtype == theirs[name][0].dtype and torch.equal(values, theirs[name][0]), name
        assert int(grid[0, 1:].prod()) // 4 == media_tokens(*SIZES[name]), name


def test_hf_backend_batches_image_samples_like_one_forward_each(tiny_kimi_k25_dir, reference, pixels, kimi_tokenizer):
    """The reference backend: Kimi-K2.5 loads (it has no causal-LM class), a right-padded batch of
    image and text samples, given the images' bytes, gives each sample's own single forward with
    vLLM's processor's pixels."""
    from eagle3_data.stages.hidden_states.backends import TransformersBackend

    backend = TransformersBackend(tiny_kimi_k25_dir, dtype=torch.float32, max_images=2)
    assert backend.info.num_layers == 8 and backend.info.vocab_size == 163_840
    batch = [prompt(kimi_tokenizer, parts, pixels) for parts in SAMPLES]
    images = [[IMAGES[p] for p in parts if p in IMAGES] for parts in SAMPLES]
    states = backend.forward(batch, INDICES, last_hidden=True, images=images)
    for parts, ids, got in zip(SAMPLES, batch, states, strict=True):
        hs = reference_states(reference, ids, [p for p in parts if p in IMAGES], pixels)
        aux = got.aux.reshape(len(ids), len(INDICES), -1)
        for j, index in enumerate(INDICES):
            assert rel_err(aux[:, j], hs[index][0]) < REL, (parts, index)
        assert rel_err(rms_norm(got.last, *backend.final_norm), hs[8][0]) < REL
    with pytest.raises(ValueError, match="a sample with 3 images, the backend takes 2"):
        backend.forward(batch[:1], INDICES, last_hidden=False, images=[[IMAGES["a"]] * 3])


def test_states_of_image_samples_equal_transformers_forward_with_the_same_pixels(
    vllm_backend, reference, pixels, kimi_tokenizer
):
    batch = [prompt(kimi_tokenizer, parts, pixels) for parts in SAMPLES]
    images = [[IMAGES[p] for p in parts if p in IMAGES] for parts in SAMPLES]
    states = vllm_backend.forward(batch, INDICES, last_hidden=True, images=images)  # ids checked against the engine's
    weight, eps = vllm_backend.final_norm
    for parts, ids, got in zip(SAMPLES, batch, states, strict=True):
        names = [p for p in parts if p in IMAGES]
        hs = reference_states(reference, ids, names, pixels)
        aux = got.aux.reshape(len(ids), len(INDICES), -1)
        for j, index in enumerate(INDICES):
            assert rel_err(aux[:, j], hs[index][0]) < REL, (parts, index)
        assert rel_err(rms_norm(got.last, weight, eps), hs[8][0]) < REL, parts
        if names:  # the image positions carry the vision tower's features, not the pad token's embedding
            pads = torch.tensor(ids) == MEDIA["pad"]
            text_only = reference_states(reference, ids, [], pixels)
            assert rel_err(aux[pads, 0], text_only[INDICES[0]][0][pads]) > 100 * REL


def test_an_unexpanded_placeholder_is_a_failure_naming_the_first_differing_position(
    vllm_backend, pixels, kimi_tokenizer
):
    """One `<|media_pad|>` where the processor gives n: the engine expands it itself, so the ids it
    saw are not ours; the failure names the position after our single pad."""
    ids = prompt(kimi_tokenizer, ["a", "What is it?"], pixels)
    first = ids.index(MEDIA["pad"])
    n = media_tokens(pixels["a"][1])
    assert n > 1
    short = ids[: first + 1] + ids[first + n :]
    with pytest.raises(PromptIdsDiffer, match=f"at position {first + 1} "):
        vllm_backend.forward([short], INDICES, last_hidden=True, images=[[IMAGES["a"]]])  # the session's layers


# -- local generation with images on `vllm serve` (engines/vllm.py: /inference/v1/generate) -----
MAX_NEW = 6


def greedy(model, ids: list[int], names: list[str], pixels: dict, stops: set[int]) -> list[int]:
    """transformers' greedy answer of Kimi_K25ForConditionalGeneration to `ids` with the same pixels
    (the whole sequence re-run per step: six steps of a tiny model), through a stop id."""
    kwargs = {}
    if names:
        kwargs = {
            "pixel_values": torch.cat([pixels[n][0] for n in names]).float(),
            "image_grid_thw": torch.cat([pixels[n][1] for n in names]),
        }
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            best = int(model(input_ids=torch.tensor([ids + out]), **kwargs).logits[0, -1].argmax())
            out.append(best)
            if best in stops:
                break
    return out


GENERATED = [["a"], ["b", "a"]]


def test_image_prompts_generated_on_vllm_serve_answer_as_transformers_with_the_same_pixels(
    vllm_server, store, kimi_tokenizer, reference, pixels, tmp_path
):
    """Each prompt goes with one pad per image and its images; vLLM's processor expands the pads,
    and the prompt ids it reports back equal ours (checked by the client, recorded in the row);
    the answer is transformers' greedy answer given vLLM's own processor's pixels, and the pads
    number what that processor's grids give (an oracle outside our count)."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.storage import StageRef
    from tests.generation_calls import generate_vllm, image_prompts

    rows = image_prompts(store, [[IMAGES[n] for n in names] for names in GENERATED])
    ref = StageRef(run_key="vllm-img", stage="generate_local", dataset="images")
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "thinking": True}
    s = generate_vllm(store, ref, rows, kimi_tokenizer, [vllm_server.url], sampling, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["ok"] == 2, s
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    got = {r["sample_id"]: r for r in store.read_table(ref).to_pylist()}
    for row, names in zip(rows, GENERATED, strict=True):
        r = got[row["sample_id"]]
        ours = fmt.generation_prompt_ids(json.loads(row["messages"]), None, json.loads(row["images"]))
        assert r["status"] == "ok" and r["prompt_ids"] == ours
        assert ours.count(MEDIA["pad"]) == sum(media_tokens(pixels[n][1]) for n in names)
        assert r["output_ids"] == greedy(reference, ours, names, pixels, set(fmt.stop_token_ids)), names
        assert json.loads(r["provenance"])["engine_request_id"].startswith("generate-tokens-")


def test_a_wrong_media_token_count_is_a_failed_row_naming_the_first_differing_position(
    vllm_server, store, kimi_tokenizer, pixels, tmp_path
):
    """Our count one more than vLLM's processor's (the reference as a drifted processor would write
    it): vLLM runs its own count, the ids it reports part from ours after its last pad."""
    from eagle3_data.storage import StageRef
    from tests.generation_calls import generate_vllm, image_prompts

    (row,) = image_prompts(store, [[IMAGES["a"]]])
    refs = json.loads(row["images"])
    n = media_tokens(pixels["a"][1])
    assert refs[0]["media_tokens"] == n
    refs[0]["media_tokens"] = n + 1
    row["images"] = json.dumps(refs)
    ref = StageRef(run_key="vllm-img", stage="generate_local", dataset="wrong")
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "thinking": True}
    s = generate_vllm(store, ref, [row], kimi_tokenizer, [vllm_server.url], sampling, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["failed"] == 1, s
    (r,) = store.read_table(ref).to_pylist()
    at = r["prompt_ids"].index(MEDIA["pad"]) + n
    assert r["error"] == (
        f"media tokens: {vllm_server.url} ran other prompt ids than ours from position {at} (ours "
        f"{MEDIA['pad']}, the engine's {MEDIA['end']}; {len(r['prompt_ids'])} ids ours, {len(r['prompt_ids']) - 1} "
        "the engine's): its processor counts another number of media tokens for an image"
    )


def test_image_answers_are_scored_with_their_images_as_transformers_scores_them(
    vllm_server, kimi_tokenizer, reference, pixels
):
    """The policy check's scoring request for an image prompt (`/inference/v1/generate` with
    `prompt_logprobs`): the answer's log-probabilities equal the log_softmax of transformers' own
    logits given vLLM's processor's pixels, and differ from scoring the ids alone (what the check
    did before: the target scored an answer about an image it was not shown). A wrong media-token
    count is a refusal naming the images, not a score."""
    from eagle3_data.engines.client import Media
    from eagle3_data.engines.vllm import VLLM
    from eagle3_data.images import data_uri
    from eagle3_data.nucleus import Item
    from eagle3_data.stages.policy import ScoreEndpoints, ScoreTimings, score_items

    names = ["b", "a"]
    ids = prompt(kimi_tokenizer, ["Compare ", "b", " with ", "a"], pixels)
    first = len(ids)
    answer = kimi_tokenizer.encode("They differ in size.", add_special_tokens=False)
    refs = json.dumps([{"media_tokens": media_tokens(pixels[n][1])} for n in names])  # Item.images: set
    media = Media(MEDIA["pad"], [data_uri(IMAGES[n]) for n in names], [media_tokens(pixels[n][1]) for n in names])
    item = Item("img", "overflow", "overflow", tuple(ids + answer), first, refs)
    timings = ScoreTimings(max_attempts=2)
    (got,), refused, _ = score_items([item], ScoreEndpoints([vllm_server.url], VLLM, timings), media=lambda _: media)
    assert not refused and len(got) == len(answer)
    with torch.no_grad():
        logits = reference(
            input_ids=torch.tensor([ids + answer]),
            pixel_values=torch.cat([pixels[n][0] for n in names]).float(),
            image_grid_thw=torch.cat([pixels[n][1] for n in names]),
        ).logits[0]
    expected = torch.log_softmax(logits.double(), -1)[first - 1 : -1].gather(1, torch.tensor(answer)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), expected, atol=1e-3), (got, expected.tolist())
    (blind,), _, _ = score_items(
        [Item("txt", "overflow", "overflow", item.ids, first)], ScoreEndpoints([vllm_server.url], VLLM, timings)
    )
    assert max(abs(a - b) for a, b in zip(got, blind)) > 1e-2  # the images moved the answer's scores
    pad = ids.index(MEDIA["pad"])  # our count one more than the processor's for the first image
    drifted = Item(
        "img", "overflow", "overflow", tuple(ids[:pad] + [MEDIA["pad"]] + ids[pad:] + answer), first + 1, refs
    )
    (none,), refused, _ = score_items(
        [drifted], ScoreEndpoints([vllm_server.url], VLLM, timings), media=lambda _: media
    )
    assert none is None and refused["img"].startswith("images: ran other prompt ids than ours"), refused
