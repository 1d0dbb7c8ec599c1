"""SGLang's wire format for the local client (`local.LocalRun`): `POST /generate` with prompt ids.

SGLang 0.5.23's protocol, as its source has it (srt/managers/io_struct.py, tokenizer_manager.py,
sampling_params.py, http_server.py):
- unknown keys inside `sampling_params` are a 400 on every request, and a few keys the request
  schema lets through crash the server instead (`choice`: a TypeError, an unhandled 500): the
  config's keys are checked against SAMPLING_KEYS, the fields of `SamplingParams`, before any request.
- `output_ids` include the matched stop token and `meta_info.finish_reason` names it; `len(output_ids)`
  must equal `meta_info.completion_tokens`, and `meta_info.prompt_tokens` the ids sent: a server
  started with `--allow-auto-truncate` cuts a long prompt's tail silently and reports the cut length.
- `weight_version` (from `/model_info`, or the deprecated `/get_model_info`) and the served model
  name (`/v1/models`) go into every row's provenance; capacity is `max_running_requests` from `/server_info`
  (`/get_server_info` before
  0.5.23 renamed it).
- A full queue (`--max-queued-requests`) answers 503 "The request queue is full.": backpressure.

Image prompts (srt/multimodal/processors/kimi_k25.py `process_mm_data_async`): `input_ids` with
exactly one image placeholder (`media_pad`) per image (the processor counts the pads and refuses a mismatch:
"Kimi image placeholders must map one-to-one to image data: expected N, found M token(s)") and
`image_data` a list, one entry per image in prompt order (GenerateReqInput's ImageDataInputItem: we
send the data URI); SGLang expands each pad to its processor's count itself (`_expand_image_token_ids`).
It reports counts, not ids: `meta_info.prompt_tokens` (the expanded prompt) and `image_tokens`
(tokenizer_manager.py: the image tokens the request consumed). Both are compared with ours; a
difference is a failed row (`MediaDiffers`) naming them, and the position of the first image's
tokens, the earliest the ids can part (SGLang names no position).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp

from eagle3_data.engines.client import (
    Answer,
    Media,
    MediaDiffers,
    PromptCut,
    Scored,
    bearer_headers,
    error_message,
    served_model,
    top_row,
)
from eagle3_data.errors import UserError
from eagle3_data.images import collapse_runs

# SGLang 0.5.23 SamplingParams fields (srt/sampling/sampling_params.py): any other key inside
# `sampling_params` is a 400 "unknown field" on every request, or (`choice`) crashes the request.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
    }
)
_RENAMED = {"seed": "sampling_seed", "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
QUEUE_FULL = "the request queue is full"


def check_sampling_params(params: Mapping[str, object], *, where: str = "generation.sampling") -> None:
    """A config error naming the key, instead of a 400 on every request."""
    for key in params:
        if key not in SAMPLING_KEYS:
            hint = f" (SGLang's key is {_RENAMED[key]!r})" if key in _RENAMED else ""
            raise UserError(
                f"{where}: {key!r} is not an SGLang sampling parameter{hint}; "
                f"accepted: {', '.join(sorted(SAMPLING_KEYS))}"
            )


class SGLangWire:
    source = "sglang"
    engine = "SGLang"
    capacity_paths = ("/server_info", "/get_server_info")
    headers: Mapping[str, str] = bearer_headers(None)  # wire_for gives a keyed copy

    def sampling(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        check_sampling_params(sampling)
        return dict(sampling)

    async def identify(self, http: aiohttp.ClientSession, endpoint: str) -> dict[str, Any]:
        """The weight version (`/model_info`) and the served model name (`/v1/models`: the
        `--served-model-name`, by default the model path)."""
        out: dict[str, Any] = {"weight_version": None, "served_model": await served_model(http, endpoint)}
        for path in ("/model_info", "/get_model_info"):
            try:
                async with http.get(f"{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                    if r.status == 200:
                        info = await r.json(content_type=None)
                        out["weight_version"] = info.get("weight_version") if isinstance(info, dict) else None
                        return out
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
        return out

    def request(
        self,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        rid: str,
        identity: dict[str, Any],
        media: Media | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """`return_logprob`: each output id's log-probability (`meta_info.output_token_logprobs`;
        with the default `logprob_start_len` -1 no prompt position is scored). An image prompt's
        ids carry one pad per image, its images go as `image_data`."""
        body = {"input_ids": prompt_ids, "sampling_params": sampling, "rid": rid, "return_logprob": True}
        if media is not None:
            body.update(input_ids=collapse_runs(prompt_ids, media.pad_id), image_data=list(media.urls))
        return "/generate", body

    def answer(self, body: Any, prompt_ids: list[int], identity: dict[str, Any], media: Media | None = None) -> Answer:
        if media is not None:
            check_media(body, prompt_ids, media)
        ids, finish, meta = check_answer(body, prompt_ids)
        return Answer(
            ids,
            finish,
            {
                "e2e_latency": meta.get("e2e_latency"),
                "cached_tokens": meta.get("cached_tokens"),
                "weight_version": meta.get("weight_version") or identity.get("weight_version"),
            },
            output_logprobs(meta, ids),
        )

    def logprob_distribution(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """SGLang reports log_softmax(logits / temperature), before top-k/top-p/min-p (its sampler
        caches them there; SGLANG_RETURN_ORIGINAL_LOGPROB on the server makes them the raw ones). A
        temperature of 0 is greedy, which SGLang runs at temperature 1 with top-k 1."""
        t = float(sampling.get("temperature", 1.0))
        return {"distribution": "temperature_scaled", "temperature": t if t > 1e-6 else 1.0}

    def backpressure(self, status: int, text: str) -> bool:
        return status == 503 and QUEUE_FULL in error_message(text).lower()

    def score_request(
        self, ids: list[int], first: int, rid: str, identity: dict[str, Any], top: int = 0, media: Media | None = None
    ) -> tuple[str, dict[str, Any]]:
        """The target's log-probability of `ids[first:]` given what precedes each: one prefill with
        `return_logprob` from `logprob_start_len = first - 1` (SGLang's first entry is None, so the
        window starts one token early), one token generated (a prefill-only request is refused
        when speculative decoding is on); with `top` > 0, `top_logprobs_num` asks for the `top`
        likeliest ids at each of those positions (`meta_info.input_top_logprobs`).

        What they are (SGLang 0.5.23, the wheel tests/fixtures/sglang_oracle.py installs): the
        log_softmax of the raw logits (srt/layers/logprob_processor.py:730-737, or logit minus the
        row's logsumexp on the fast path, :78-95), never temperature-scaled or top-p-normalised for
        input positions (`Req.temp_scaled_logprobs`/`top_p_normalized_logprobs` stay False,
        srt/managers/schedule_batch.py:1293-1294; temperature 0 is run as 1.0 with top_k 1,
        srt/sampling/sampling_params.py:245-248). `input_top_logprobs` lines up with
        `input_token_logprobs`: None first, then per position a list of `top`
        `[logprob, id, text]` (torch.topk's order; the id there only when it is among them),
        the sampling position's popped (srt/managers/scheduler_components/logprob_result_processor.py
        :58-82 `_process_input_top_logprobs`, srt/managers/tokenizer_manager.py:3098-3135). SGLang
        sets no cap on `top`.

        An image prompt's ids go with one pad per image and its `image_data`, as in `request`:
        SGLang expands the pads before the scheduler (`Req.origin_input_ids` are the expanded ids,
        srt/managers/scheduler.py:3223 `duplicate_pad_mm_input_ids`), and `logprob_start_len` is
        checked against those (:3275), so `first` counts our expanded ids as the window does."""
        body = {
            "input_ids": collapse_runs(ids, media.pad_id) if media is not None else ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": first - 1,
            "rid": rid,
        }
        if top:
            body["top_logprobs_num"] = top
        if media is not None:
            body["image_data"] = list(media.urls)
        return "/generate", body

    def score_answer(self, body: Any, ids: list[int], first: int, top: int = 0, media: Media | None = None) -> Scored:
        if media is not None:
            check_media(body, ids, media)  # it ran as many ids as ours, and our media tokens
        meta = (body[0] if isinstance(body, list) else body)["meta_info"]
        window = meta["input_token_logprobs"][1:]  # entry 0: ids[first - 1], whose value SGLang leaves None
        if len(window) != len(ids) - first or any(e[1] != t for e, t in zip(window, ids[first:])):
            raise ValueError(f"input_token_logprobs cover {len(window)} ids, not the {len(ids) - first} scored")
        if not top:
            return Scored([float(e[0]) for e in window])
        tops = meta["input_top_logprobs"][1:]
        if len(tops) != len(window):
            raise ValueError(f"input_top_logprobs cover {len(tops)} positions, not the {len(window)} scored")
        return Scored(
            [float(e[0]) for e in window],
            [top_row([e[0] for e in row], top, f"input_top_logprobs[{i + 1}]") for i, row in enumerate(tops)],
        )

    def score_refusal(self, status: int, text: str) -> str | None:
        return None  # SGLang refuses a scoring request for the item alone (longer than its context, say)

    def manifest_extra(self, identities: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"weight_versions": {e: i.get("weight_version") for e, i in identities.items()}}


SGLANG = SGLangWire()


def check_answer(
    answer: dict[str, Any] | list[dict[str, Any]], prompt_ids: list[int] | None = None
) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """(output_ids as given, finish_reason object as given, meta_info) of a /generate answer.
    SGLang's output_ids run through the matched stop token; they must number `completion_tokens`,
    and `prompt_tokens` must be the number of ids sent (PromptCut otherwise)."""
    if isinstance(answer, list):
        answer = answer[0]
    ids = answer["output_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("output_ids is not a list of ints")
    meta = answer["meta_info"]
    finish = meta["finish_reason"]
    if isinstance(finish, str):
        finish = {"type": finish}
    if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
        raise ValueError(f"meta_info.finish_reason {finish!r}")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise ValueError(f"len(output_ids) = {len(ids)} but meta_info.completion_tokens = {completion}")
    ran = meta.get("prompt_tokens")
    if prompt_ids is not None and ran is not None and ran != len(prompt_ids):
        raise PromptCut(
            f"{len(prompt_ids)} prompt ids sent, meta_info.prompt_tokens = {ran}: the server "
            "truncated the prompt (--allow-auto-truncate?); its answer is not the model's to this prompt"
        )
    return ids, finish, meta


def check_media(answer: dict[str, Any], prompt_ids: list[int], media: Media) -> None:
    """An image prompt's counts as SGLang ran them: `meta_info.prompt_tokens` must be the length of
    our expanded ids and `image_tokens` (when reported) our media tokens (MediaDiffers otherwise)."""
    meta = (answer[0] if isinstance(answer, list) else answer)["meta_info"]
    ran, images = meta.get("prompt_tokens"), meta.get("image_tokens")
    ours = sum(media.tokens)
    if (ran is not None and ran != len(prompt_ids)) or (images is not None and images != ours):
        first = prompt_ids.index(media.pad_id) if media.pad_id in prompt_ids else 0
        raise MediaDiffers(
            f"ran {ran} prompt tokens ({images} of them images), ours are {len(prompt_ids)} ({ours} media "
            f"tokens for {len(media.tokens)} image(s)): its processor counts another number of media tokens "
            f"for an image; the ids part at position {first} (the first image's) or later"
        )


def output_logprobs(meta: Mapping[str, Any], ids: list[int]) -> list[float] | None:
    """`meta_info.output_token_logprobs` (`[logprob, id, text]` per output id) as floats, checked
    against the output ids; None when the server sent none."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    if len(entries) != len(ids) or any(e[1] != t for e, t in zip(entries, ids)):
        raise ValueError(
            f"meta_info.output_token_logprobs cover {len(entries)} ids that are not the {len(ids)} output ids"
        )
    return [float(e[0]) for e in entries]
