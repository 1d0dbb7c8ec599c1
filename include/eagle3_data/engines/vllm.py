"""vLLM's wire format for the local client (`local.LocalRun`): `vllm serve`'s OpenAI API with
prompt ids in and exact ids out; the rows differ from SGLang's only by `source` ("vllm").

vLLM 0.32's protocol (`vllm/entrypoints/openai/completion/protocol.py`, tried against a real
server on CPU):
- `POST /v1/completions` with `"prompt": [ids]` (token ids, never text: the ids recorded are the
  ids the model saw) and `"return_token_ids": true` answers `choices[0].prompt_token_ids` and
  `choices[0].token_ids`. Both are checked: the prompt ids must come back unchanged.
- `token_ids` include the matched stop token (`finish_reason: "stop"`, `stop_reason` the id,
  or null for the checkpoint's eos); `finish_reason: "length"` at `max_tokens`.
- `stop_token_ids` is always sent from the audited ids; `skip_special_tokens: false` keeps the
  text honest (the ids are what is stored). Sampling keys are the config's (SGLang's names) and
  renamed here: max_new_tokens -> max_tokens, min_new_tokens -> min_tokens, sampling_seed -> seed;
  anything else must be a vLLM key (SAMPLING_KEYS) or the run is refused before any request.
- `"logprobs": 0` returns each completion id's log-probability (`choices[0].logprobs.token_logprobs`).
- `/v1/models` names the served model (sent as `model`, recorded in provenance). vLLM reports no
  capacity on a production server (`/server_info` is VLLM_SERVER_DEV_MODE only).

Image prompts: `/v1/completions` takes ids or text and nothing beside them (CompletionRequest.prompt,
vllm/entrypoints/openai/completion/protocol.py:52), so they go to the tokens-in route,
`POST /inference/v1/generate` (entrypoints/scale_out/token_in_token_out; registered by
`vllm serve --enable-scale-out`): `token_ids` with one image placeholder (`media_pad`) per image and
`content_parts` `[{"type": "image_url", "url": <data URI>}]` in prompt order (serving.py
`serve_tokens`: the parts become the prompt's `multi_modal_data`, Kimi-K2.5's `vision_chunk`,
and the renderer's Kimi-K2.5 processor replaces each pad by its own count of media tokens,
kimi_k25.py `_get_prompt_updates`), `sampling_params` (vLLM's SamplingParams: the same fields as
above, `logprobs: 0`), `return_token_ids: true`. The answer's `prompt_token_ids` are the ids the
model ran, pads expanded: compared with ours, a difference is a failed row naming the first
differing position (`MediaDiffers`). `choices[0].token_ids`, `finish_reason`, `stop_reason` as in
completions; `choices[0].logprobs.content[i].logprob` per completion id.
"""

from __future__ import annotations

import json
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
    served_model,
    top_row,
)
from eagle3_data.errors import UserError
from eagle3_data.images import collapse_runs, first_difference

# Config (SGLang) name -> vLLM completion-request field.
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
# vLLM 0.32 CompletionRequest sampling fields accepted from the config (after RENAMED).
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "ignore_eos",
    }
)


def vllm_sampling(sampling: Mapping[str, object], *, where: str = "generation.sampling") -> dict[str, Any]:
    """The config's sampling params as a vLLM completion request's fields; a bad key is a UserError."""
    out = {}
    for key, value in sampling.items():
        name = RENAMED.get(key, key)
        if name not in SAMPLING_KEYS:
            raise UserError(
                f"{where}: {key!r} is not a sampling parameter the vLLM client sends; "
                f"accepted: {', '.join(sorted(set(SAMPLING_KEYS) | set(RENAMED)))}"
            )
        out[name] = value
    if out.get("top_k") == -1:
        out["top_k"] = 0  # the config's (SGLang's) "whole vocabulary" is vLLM's 0
    return out


class VllmWire:
    source = "vllm"
    engine = "vLLM"
    capacity_paths: tuple[str, ...] = ()
    headers: Mapping[str, str] = bearer_headers(None)  # wire_for gives a keyed copy

    def sampling(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        return vllm_sampling(sampling)

    async def identify(self, http: aiohttp.ClientSession, endpoint: str) -> dict[str, Any]:
        """vLLM has no weight version: the served model name, from /v1/models."""
        return {"served_model": await served_model(http, endpoint)}

    def request(
        self,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        rid: str,
        identity: dict[str, Any],
        media: Media | None = None,
    ) -> tuple[str, dict[str, Any]]:
        if media is not None:
            return GENERATE_PATH, generate_body(prompt_ids, sampling, rid, identity, media)
        body = {
            "prompt": prompt_ids,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
            "logprobs": 0,
            **sampling,
        }
        if identity.get("served_model"):
            body["model"] = identity["served_model"]
        return "/v1/completions", body

    def answer(self, body: Any, prompt_ids: list[int], identity: dict[str, Any], media: Media | None = None) -> Answer:
        if media is not None:
            ids, finish, body = check_generate_answer(body, prompt_ids)
            return Answer(
                ids,
                finish,
                {"served_model": body.get("model"), "engine_request_id": body.get("request_id")},
                generate_logprobs(body["choices"][0], ids),
            )
        ids, finish, body = check_answer(body, prompt_ids)
        return Answer(
            ids,
            finish,
            {"served_model": body.get("model"), "engine_request_id": body.get("id")},
            output_logprobs(body["choices"][0], ids),
        )

    def logprob_distribution(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's default `--logprobs-mode raw_logprobs`: the model's own distribution, before any
        temperature, penalty or top-k/top-p processing (a server started with another mode
        reports other numbers: leave the default)."""
        return {"distribution": "raw"}

    def backpressure(self, status: int, text: str) -> bool:
        return False  # vLLM queues without a bound: no "full" answer

    def score_request(
        self, ids: list[int], first: int, rid: str, identity: dict[str, Any], top: int = 0, media: Media | None = None
    ) -> tuple[str, dict[str, Any]]:
        """The target's log-probability of `ids[first:]`: `prompt_logprobs: top` returns, at every
        prompt position (all of them: the request has no start), the log-probability of the id
        that is there and of the `top` likeliest ids; one token generated (vLLM's minimum).

        What they are (vLLM 0.32): the log_softmax of the raw logits in fp32
        (v1/worker/gpu_model_runner.py:5382-5390 `_get_prompt_logprobs_dict`, the CPU runner's
        too: prompt tokens skip the sampling processors, so no temperature, penalty or top-k/top-p
        whatever the request; v1/sample/sampler.py:308-309 `compute_logprobs`), unless the server
        runs `--logprobs-mode raw_logits`/`processed_logits` (config/model.py:287-295), which sends
        logits there: `top_row` refuses values that are not log-probabilities. The top ids are
        torch.topk's (sampler.py:312-359 `gather_logprobs`), ranks 1..top; the dict of a position
        holds the id that is there first (its own rank: 1 + the ids above it) and the top after it
        (logprobs.py:178 `append_logprobs_for_next_position`): `top` entries when that id is among
        them, `top` + 1 when not. -inf is sent as -9999.0 (entrypoints/generate/base/serving.py:359
        `clamp_prompt_logprobs`). Position 0 is null.

        The server caps `top` at `--max-logprobs` (config/model.py:282, default 20): above it every
        request is a 400 `{"error": {"message": "Requested prompt logprobs of K, which is greater
        than max allowed: M (parameter=prompt_logprobs, value=K)", "type": "BadRequestError",
        "param": "prompt_logprobs", "code": 400}}` (sampling_params.py:969-979,
        entrypoints/serve/exception_handling/error_response.py:41-44; `score_refusal`).

        An image prompt goes where its generation went, `/inference/v1/generate` (`generate_body`:
        one pad per image, the images as `content_parts`), with `prompt_logprobs` among its
        sampling params: the answer's top-level `prompt_logprobs` (GenerateResponseBase,
        entrypoints/scale_out/token_in_token_out/protocol.py:507; the same per-position dicts,
        over the ids the engine ran, pads expanded) and `prompt_token_ids`, which must be ours."""
        if media is not None:
            sampling = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top}
            return GENERATE_PATH, generate_body(ids, sampling, rid, identity, media)
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top, "stream": False}
        if identity.get("served_model"):
            body["model"] = identity["served_model"]
        return "/v1/completions", body

    def score_answer(self, body: Any, ids: list[int], first: int, top: int = 0, media: Media | None = None) -> Scored:
        if media is not None:
            check_generate_answer(body, ids)  # the ids it ran, pads expanded by its processor, are ours
            per_position = body["prompt_logprobs"]
        else:
            per_position = body["choices"][0]["prompt_logprobs"]
        if len(per_position) != len(ids):
            raise ValueError(f"prompt_logprobs has {len(per_position)} positions for {len(ids)} ids")
        logprobs, tops = [], []
        for i in range(first, len(ids)):
            entries, own = per_position[i], str(ids[i])
            logprobs.append(float(entries[own]["logprob"]))
            if top:  # the id there is one of the top when the dict holds no more than `top`
                values = [e["logprob"] for key, e in entries.items() if key != own or len(entries) == top]
                tops.append(top_row(values, top, f"prompt_logprobs[{i}]"))
        return Scored(logprobs, tops if top else None)

    def score_refusal(self, status: int, text: str) -> str | None:
        """A 400 on `prompt_logprobs`: more than the server's `--max-logprobs`, refused to every item."""
        try:
            error = json.loads(text).get("error") or {}
        except (ValueError, AttributeError):
            return None
        if status == 400 and isinstance(error, dict) and error.get("param") == "prompt_logprobs":
            return (
                f"{error.get('message')}: start vllm serve with --max-logprobs at least policy.top_logprobs, "
                "or lower policy.top_logprobs"
            )
        return None

    def manifest_extra(self, identities: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"engine": self.source, "served_models": {e: i.get("served_model") for e, i in identities.items()}}


VLLM = VllmWire()


GENERATE_PATH = "/inference/v1/generate"


def generate_body(
    prompt_ids: list[int], sampling: dict[str, Any], rid: str, identity: dict[str, Any], media: Media
) -> dict[str, Any]:
    """An image prompt's `/inference/v1/generate` request (vLLM's GenerateRequest): our ids with
    each image's pad run cut to one pad, the images as `content_parts` in prompt order."""
    body = {
        "request_id": rid,
        "token_ids": collapse_runs(prompt_ids, media.pad_id),
        "content_parts": [{"type": "image_url", "url": url} for url in media.urls],
        "sampling_params": {"logprobs": 0, "skip_special_tokens": False, **sampling},
        "return_token_ids": True,
        "stream": False,
    }
    if identity.get("served_model"):
        body["model"] = identity["served_model"]
    return body


def check_generate_answer(
    answer: dict[str, Any], prompt_ids: list[int]
) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """(completion ids, {"type", "matched"}, answer) of an `/inference/v1/generate` answer, whose
    `prompt_token_ids` (the ids the model ran, each image's pads expanded by the engine's processor)
    must be our expanded `prompt_ids` (MediaDiffers naming the first differing position)."""
    choice = answer["choices"][0]
    ids = _token_ids(choice, "")
    ran = answer.get("prompt_token_ids")
    if not isinstance(ran, list):
        raise ValueError("no prompt_token_ids in the answer (return_token_ids is sent: is this vLLM 0.32?)")
    at = first_difference(prompt_ids, ran)
    if at is not None:
        ours = prompt_ids[at] if at < len(prompt_ids) else "end"
        theirs = ran[at] if at < len(ran) else "end"
        raise MediaDiffers(
            f"ran other prompt ids than ours from position {at} (ours {ours}, the engine's {theirs}; "
            f"{len(prompt_ids)} ids ours, {len(ran)} the engine's): its processor counts another number "
            "of media tokens for an image"
        )
    return ids, _finish(answer, choice, ids), answer


def generate_logprobs(choice: Mapping[str, Any], ids: list[int]) -> list[float] | None:
    """`choices[0].logprobs.content[i].logprob` (the sampled id's, checked against it); None when absent."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return None
    if len(content) != len(ids) or any(c.get("token_id") != t for c, t in zip(content, ids)):
        raise ValueError(
            f"choices[0].logprobs.content covers {len(content)} ids that are not the {len(ids)} output ids"
        )
    return [float(c["logprob"]) for c in content]


def check_answer(answer: dict[str, Any], prompt_ids: list[int]) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """(completion ids as given, {"type", "matched"}, answer) of a /v1/completions answer.

    The engine must echo the prompt ids it ran (`prompt_token_ids`, PromptCut otherwise) and return
    as many completion ids as `usage.completion_tokens` counts; the matched stop token is inside
    `token_ids`."""
    choice = answer["choices"][0]
    ids = _token_ids(choice, " (is return_token_ids supported?)")
    if choice.get("prompt_token_ids") is not None and list(choice["prompt_token_ids"]) != list(prompt_ids):
        raise PromptCut(
            f"choices[0].prompt_token_ids differ from the prompt ids sent ({len(choice['prompt_token_ids'])} "
            f"ids ran, {len(prompt_ids)} sent)"
        )
    return ids, _finish(answer, choice, ids), answer


def _token_ids(choice: Mapping[str, Any], hint: str) -> list[int]:
    """`choices[0].token_ids`, checked to be a list of ints (ValueError naming the field, + `hint`)."""
    ids = choice["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"choices[0].token_ids is not a list of ints{hint}")
    return ids


def _finish(answer: Mapping[str, Any], choice: Mapping[str, Any], ids: list[int]) -> dict[str, Any]:
    """{"type", "matched"} of a choice whose completion ids `usage.completion_tokens` must count."""
    completion = (answer.get("usage") or {}).get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise ValueError(f"len(token_ids) = {len(ids)} but usage.completion_tokens = {completion}")
    kind = choice.get("finish_reason")
    if not isinstance(kind, str):
        raise ValueError(f"choices[0].finish_reason {kind!r}")
    return {"type": kind, "matched": choice.get("stop_reason")}


def output_logprobs(choice: Mapping[str, Any], ids: list[int]) -> list[float] | None:
    """`choices[0].logprobs.token_logprobs` as floats, one per completion id; None when absent."""
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if values is None:
        return None
    if len(values) != len(ids) or any(v is None for v in values):
        raise ValueError(f"choices[0].logprobs.token_logprobs has {len(values)} values for {len(ids)} completion ids")
    return [float(v) for v in values]
