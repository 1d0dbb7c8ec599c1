"""Local generation on vLLM: `vllm serve`'s OpenAI API with prompt ids in and exact ids out.

Everything but the wire format is the SGLang client's (generation/sglang.py): the same shared
queue and per-endpoint workers, warm-up polling of `/health`, endpoint drop and re-admission,
retries with backoff, `StageRun` checkpoints, journal and resume, and the same record schema,
so the gate and merge tell the engines apart only by `source` ("vllm").

vLLM 0.32's protocol (`vllm/entrypoints/openai/completion/protocol.py`, tried against a real
server on CPU):
- `POST /v1/completions` with `"prompt": [ids]` (token ids, never text: the ids recorded are the
  ids the model saw) and `"return_token_ids": true` answers `choices[0].prompt_token_ids` and
  `choices[0].token_ids`. Both are checked: the prompt ids must come back unchanged.
- `token_ids` include the matched stop token (`finish_reason: "stop"`, `stop_reason` the id,
  or null for the checkpoint's eos); `finish_reason: "length"` at `max_tokens`.
- `stop_token_ids` is always sent from the audited ids; `skip_special_tokens: false` keeps the
  text honest (the ids are what is stored). Sampling keys are SGLang's names (the config is
  engine-neutral) and renamed here: max_new_tokens -> max_tokens, min_new_tokens -> min_tokens,
  sampling_seed -> seed; anything else must be a vLLM key (SAMPLING_KEYS) or the run is refused
  before any request.
- `/v1/models` names the served model (sent as `model`, recorded in provenance).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import aiohttp

from eagle3_data.errors import UserError
from eagle3_data.generation.sglang import _SGLangRun, run_local_stage


SOURCE = "vllm"

# Config (SGLang) name -> vLLM completion-request field.
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
# vLLM 0.32 CompletionRequest sampling fields accepted from the config (after RENAMED).
SAMPLING_KEYS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
})


def vllm_sampling(sampling: Mapping[str, object], *, where: str = "generation.sampling") -> dict:
    """The config's sampling params as a vLLM completion request's fields; a bad key is a UserError."""
    out = {}
    for key, value in sampling.items():
        name = RENAMED.get(key, key)
        if name not in SAMPLING_KEYS:
            raise UserError(f"{where}: {key!r} is not a sampling parameter the vLLM client sends; "
                            f"accepted: {', '.join(sorted(set(SAMPLING_KEYS) | set(RENAMED)))}")
        out[name] = value
    return out


def generate_local(store, ref, prompts: Iterable[dict], tokenizer, endpoints: Sequence[str], sampling: dict,
                   **options) -> dict:
    """`sglang.generate_local`'s contract on vLLM OpenAI servers (`endpoints`: base URLs without /v1)."""
    return run_local_stage(_VllmRun, store, ref, prompts, tokenizer, endpoints, sampling, **options)


class _VllmRun(_SGLangRun):
    """The SGLang client's scheduling, retries and bookkeeping; vLLM's request and answer."""

    SOURCE = SOURCE
    ENGINE = "vLLM"
    # vLLM reports no capacity on a production server (/server_info is VLLM_SERVER_DEV_MODE only;
    # /metrics has running/waiting counts, not max_num_seqs): in flight comes from the config.
    CAPACITY_PATHS = ()

    @staticmethod
    def request_sampling(sampling: dict) -> dict:
        return vllm_sampling(sampling)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served: dict[str, str | None] = {}

    def finish_extra(self) -> dict:
        return {"engine": SOURCE, "served_models": self.served}

    async def _weight_version(self, endpoint: str) -> str | None:
        """vLLM has no weight version; ask /v1/models for the served model name instead."""
        try:
            async with self.http.get(f"{endpoint}/v1/models", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                if r.status == 200:
                    data = (await r.json(content_type=None)).get("data") or []
                    self.served[endpoint] = data[0]["id"] if data else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            self.served[endpoint] = None
        return None

    def _request(self, endpoint: str, prompt_ids: list[int], sampling: dict, rid: str) -> tuple[str, dict]:
        body = {"prompt": prompt_ids, "return_token_ids": True, "skip_special_tokens": False,
                "stream": False, **sampling}
        if self.served.get(endpoint):
            body["model"] = self.served[endpoint]
        return "/v1/completions", body

    def _answer(self, answer, prompt_ids: list[int], endpoint: str) -> tuple[list[int], dict, dict]:
        ids, finish, answer = check_answer(answer, prompt_ids)
        return ids, finish, {"served_model": answer.get("model"), "engine_request_id": answer.get("id")}


def check_answer(answer: dict, prompt_ids: list[int]) -> tuple[list[int], dict, dict]:
    """(completion ids as given, {"type", "matched"}, answer) of a /v1/completions answer.

    The engine must echo the prompt ids it ran (`prompt_token_ids`) and return as many completion
    ids as `usage.completion_tokens` counts; the matched stop token is inside `token_ids`."""
    choice = answer["choices"][0]
    ids = choice["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("choices[0].token_ids is not a list of ints (is return_token_ids supported?)")
    if choice.get("prompt_token_ids") is not None and list(choice["prompt_token_ids"]) != list(prompt_ids):
        raise ValueError("choices[0].prompt_token_ids differ from the prompt ids sent")
    completion = (answer.get("usage") or {}).get("completion_tokens")
    if completion is not None and completion != len(ids):
        raise ValueError(f"len(token_ids) = {len(ids)} but usage.completion_tokens = {completion}")
    kind = choice.get("finish_reason")
    if not isinstance(kind, str):
        raise ValueError(f"choices[0].finish_reason {kind!r}")
    return ids, {"type": kind, "matched": choice.get("stop_reason")}, answer
