"""Dev inference server: SGLang's `/generate` and OpenRouter-shaped `/v1/chat/completions`.

The only stand-in in the pipeline: it replaces the two engines that cannot run here (Kimi-K2.5 on
SGLang, Kimi-K2.5 behind OpenRouter) and speaks their wire protocols, so the real clients are
tested unchanged. Both endpoints share one generator (`DevTextModel`) driven by the prompt ids,
and the chat endpoint gets its prompt ids from the tokenizer's chat template: for the same prompt
and seed, the chat answer is exactly the text of the ids `/generate` returns (unless a content
fault is injected, which is the point of injecting it).

Which dataset a request belongs to (its non-canonical BPE rate) comes from the `X-Eagle3-Dataset`
header; `X-Eagle3-Sample-Id` keys the per-sample request counters (`GET /dev/stats`) that tests
use to prove no sample is paid twice. Real servers ignore both headers.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import time
import uuid
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eagle3_data.dev.faults import ServerConfig
from eagle3_data.dev.text_model import DevTextModel, Generation
from eagle3_data.images import MEDIA_PAD, ImageError, expand_media, media_tokens, probe

DATASET_HEADER = "x-eagle3-dataset"
SAMPLE_HEADER = "x-eagle3-sample-id"


class Stats:
    """Per-endpoint counters: requests and answered (billed) generations per sample key."""

    def __init__(self) -> None:
        self.requests: dict[str, Counter] = defaultdict(Counter)
        self.answered: dict[str, Counter] = defaultdict(Counter)
        self.faults: dict[str, Counter] = defaultdict(Counter)
        self.in_flight: Counter = Counter()
        self.max_in_flight: Counter = Counter()
        self.total_answered: Counter = Counter()
        self.abandoned: Counter = Counter()

    def to_dict(self) -> dict:
        return {
            "requests": {k: dict(v) for k, v in self.requests.items()},
            "answered": {k: dict(v) for k, v in self.answered.items()},
            "faults": {k: dict(v) for k, v in self.faults.items()},
            "max_in_flight": dict(self.max_in_flight),
            "total_answered": dict(self.total_answered),
            "abandoned": dict(self.abandoned),
        }


class _State:
    """What `POST /dev/config` replaces: the config, the generator built from it, the counters."""

    def __init__(self, tok, config: ServerConfig):
        self.tok = tok
        self.reset(config)

    def reset(self, config: ServerConfig) -> None:
        self.config = config
        self.ready_at = time.monotonic() + config.warmup_s
        self.rids: set[str] = set()  # registered (in-flight) request ids, as SGLang keeps them
        self.generations: dict[str, dict] = {}  # chat answers by id: GET /v1/generation's records
        self.lookups: Counter = Counter()  # GET /v1/generation tries per id (generation_lag)
        self.recorded_at: dict[str, float] = {}  # monotonic time each record was made (record_delay_s)
        self.refused = 0
        if hasattr(self, "model"):
            self.model.rates = config.noncanonical_rates()  # keeps its vocabulary tables
        else:
            self.model = DevTextModel(self.tok, config.noncanonical_rates())
        self.stats = Stats()


def create_app(tokenizer, config: ServerConfig | None = None) -> FastAPI:
    """`tokenizer`: a loaded HF tokenizer or its directory."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    tok = tokenizer
    state = _State(tok, config or ServerConfig())
    app = FastAPI(title="eagle3-data dev inference server")

    @lru_cache(maxsize=65536)
    def generate_cached(prompt: tuple[int, ...], max_new: int, temperature: float, seed, dataset) -> Generation:
        return state.model.generate(
            list(prompt), max_new_tokens=max_new, temperature=temperature, seed=seed, dataset=dataset
        )

    @lru_cache(maxsize=65536)
    def chat_prompt(key: str) -> tuple[int, ...]:
        messages, tools, thinking = json.loads(key)
        kwargs = {} if thinking else {"thinking": False}
        ids = tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        return tuple(ids)

    async def admit(endpoint: str, request: Request, key: str, wait: bool = True):
        """Count the request, draw its faults, sleep its latency (`wait`; else a stream spends it
        sending keep-alives); returns (error, rewrites, faults, latency)."""
        state.stats.requests[endpoint][key] += 1
        faults = state.config.faults(endpoint)
        error, rewrites, latency = faults.draw(state.config.rng(endpoint, key, state.stats.requests[endpoint][key]))
        arrived = sum(state.stats.requests[endpoint].values())
        if (
            faults.stall_after is not None
            and faults.stall_after < arrived <= faults.stall_after + faults.stall_requests
        ):
            state.stats.faults[endpoint]["stall"] += 1
            error, latency = None, faults.stall_s  # accepted, then never answered in time: a hung engine
        latency = faults.timeout_sleep_s if error == "timeout" else latency
        if wait:
            state.stats.in_flight[endpoint] += 1
            state.stats.max_in_flight[endpoint] = max(
                state.stats.max_in_flight[endpoint], state.stats.in_flight[endpoint]
            )
            try:
                await asyncio.sleep(latency)
            finally:
                state.stats.in_flight[endpoint] -= 1
        if error in (None, "timeout", "malformed_json", "empty_content", "choice_error"):  # answers that are billed
            if faults.credits_after is not None and state.stats.total_answered[endpoint] >= faults.credits_after:
                error = "credits"
            elif faults.forbidden_after is not None and state.stats.total_answered[endpoint] >= faults.forbidden_after:
                error = "forbidden"
            else:
                state.stats.total_answered[endpoint] += 1
        if error:
            state.stats.faults[endpoint][error] += 1
        return (None if error == "timeout" else error), rewrites, faults, latency

    async def delivered(endpoint: str, key: str, request: Request) -> bool:
        """Count an answer as delivered (billed) unless its client is gone; such answers are
        `abandoned` (a real provider may still bill them: see docs/generation.md)."""
        if await request.is_disconnected():
            state.stats.abandoned[endpoint] += 1
            return False
        state.stats.answered[endpoint][key] += 1
        return True

    def unavailable() -> bool:
        down = 0 < state.refused < state.config.refuse_first
        return down or not state.config.healthy or time.monotonic() < state.ready_at

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        """SGLang answers 503 while warming up (its /health runs a one-token generation)."""
        return Response(status_code=503 if unavailable() else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        """The OpenAI-compatible model list (OpenRouter, vLLM and SGLang all serve it); OpenRouter's
        cards also carry the model's dated `canonical_slug`."""
        price = state.config.price_per_token
        return {
            "object": "list",
            "data": [
                {
                    "id": state.config.model,
                    "canonical_slug": state.config.canonical_slug,
                    "object": "model",
                    "owned_by": "dev",
                    "pricing": {"prompt": str(price["prompt"]), "completion": str(price["completion"])},
                }
            ],
        }

    @app.get("/v1/providers")
    async def providers() -> dict:
        """OpenRouter's provider table: display names and the slugs routing takes."""
        return {
            "data": [
                dict(p, privacy_policy_url=None, terms_of_service_url=None, status_page_url=None)
                for p in state.config.providers
            ]
        }

    @app.get("/v1/generation")
    async def generation(id: str = "") -> Response:
        """OpenRouter's record of a chat generation (`total_cost` in USD); like the real one it
        answers 404 for a moment after the completion (`generation_lag` times per id, and for
        `record_delay_s` after it was made)."""
        state.lookups[id] += 1
        record, faults = state.generations.get(id), state.config.faults("chat")
        if (
            record is None
            or state.lookups[id] <= faults.generation_lag
            or time.monotonic() < state.recorded_at.get(id, 0.0) + faults.record_delay_s
        ):
            return _openrouter_error(404, "Resource not found")
        return JSONResponse({"data": record})

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated name, still served by SGLang 0.5.23
    async def model_info() -> dict:
        return {
            "model_path": state.config.model,
            "tokenizer_path": str(tok.name_or_path),
            "is_generation": True,
            "weight_version": state.config.weight_version,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated name, still served by SGLang 0.5.23
    async def server_info() -> dict:
        """SGLang's server info, the part a client reads: server args merged with the scheduler's
        init info, one `internal_states` entry per data-parallel rank, the version. Only
        `max_running_requests` is the config's (`max_running_requests`, None as when SGLang was
        launched without `--max-running-requests`); the rest are fixed stand-ins."""
        mrr = state.config.max_running_requests
        return {
            "model_path": state.config.model,
            "tokenizer_path": str(tok.name_or_path),
            "dp_size": 1,
            "max_running_requests": mrr,
            "max_total_num_tokens": 1 << 20,
            "max_req_input_len": (1 << 20) - 1,
            "status": "ready",
            "weight_version": state.config.weight_version,
            "internal_states": [{"max_running_requests": mrr, "last_gen_throughput": 0.0}],
            "version": "0.5.23",
        }

    @app.get("/dev/stats")
    async def dev_stats() -> dict:
        """The counters, and what the chat endpoint billed: every generation it started (answered,
        abandoned or cut), as OpenRouter's records would add up."""
        return {
            **state.stats.to_dict(),
            "billed_usd": round(sum(g["total_cost"] for g in state.generations.values()), 10),
            "generations": len(state.generations),
        }

    @app.post("/dev/config")
    async def dev_config(request: Request) -> Response:
        """Replace the config (same keys as the YAML) and reset the counters: lets one server
        process serve many test scenarios instead of paying its start-up for each."""
        from eagle3_data.dev.faults import config_from_dict
        from eagle3_data.errors import UserError

        try:
            new = config_from_dict(await request.json(), source="POST /dev/config")
        except (UserError, TypeError, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        state.reset(new)
        generate_cached.cache_clear()
        return JSONResponse({"ok": True})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        """SGLang's /generate, protocol-true: it rejects what SGLang 0.5.23 rejects, in its shapes
        (schema errors `{"error": "<str>"}`, input errors `{"error": {"message": ...}}`)."""
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "expected value at line 1 column 1"}, status_code=400)
        if unavailable() or state.refused < state.config.refuse_first:
            state.refused += 1
            return JSONResponse({"error": {"message": "The server is not ready"}}, status_code=503)
        problem = _generate_contract_error(body)
        if problem is not None:
            return JSONResponse({"error": problem}, status_code=400)
        batch, prompts = _generate_prompts(body, tok)
        if prompts is None:
            return JSONResponse(
                {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}, status_code=400
            )
        vocab = len(tok)
        for prompt in prompts:
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                return JSONResponse(
                    {"error": {"message": f"The input_ids {bad} is out of the vocabulary (vocab size {vocab})."}},
                    status_code=400,
                )
        if body.get("image_data") is not None:
            try:
                expanded, image_tokens = _with_images(prompts, body["image_data"], tok, state.config.media_token_drift)
            except ValueError as exc:  # SGLang's processor raises ValueError: a 400 with its message
                return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
            prompts, body = [expanded], {**body, "dev_image_tokens": image_tokens}  # meta_info.image_tokens
        sp = body.get("sampling_params") or {}
        if "choice" in sp:  # in the request schema, not in SamplingParams: a TypeError the route does not catch
            return Response("Internal Server Error", status_code=500, media_type="text/plain")
        if (cut := state.config.auto_truncate_to) is not None:
            prompts = [p[:cut] for p in prompts]  # --allow-auto-truncate: the tail is dropped, silently
        rids = body.get("rid")
        rid_list = [r for r in (rids if isinstance(rids, list) else [rids]) if r is not None]
        duplicate = next((r for r in rid_list if r in state.rids), None)
        if duplicate is not None:
            return JSONResponse({"error": {"message": f"Duplicate request ID detected: {duplicate}"}}, status_code=400)
        state.rids.update(rid_list)
        try:
            return await _answer_generate(request, body, batch, prompts, sp, rids)
        finally:
            state.rids.difference_update(rid_list)

    async def _answer_generate(request: Request, body: dict, batch: bool, prompts, sp: dict, rids) -> Response:
        key = request.headers.get(SAMPLE_HEADER) or (json.dumps(rids) if rids else str(hash(tuple(prompts[0]))))
        error, _, faults, _ = await admit("generate", request, key)
        if error == "queue_full":  # SGLang's HTTPException handler: an ErrorResponse body
            return JSONResponse(
                {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503},
                status_code=503,
            )
        if error and error not in ("malformed_json", "empty_content"):
            return _error_response(error, faults)
        dataset = request.headers.get(DATASET_HEADER)
        outs = []
        started = time.time()
        override = state.config.stop_id_override
        for i, prompt in enumerate(prompts):
            gen = generate_cached(
                tuple(prompt),
                int(sp.get("max_new_tokens", 128)),
                float(sp.get("temperature", 1.0)),
                sp.get("sampling_seed"),
                dataset,
            )
            generated = list(gen.output_ids)
            matched = gen.matched_stop
            if matched is not None and override is not None:  # a server told to stop on another id
                generated[-1] = matched = override
            ids = generated
            if matched is not None and not state.config.include_stop_in_output_ids:
                ids = ids[:-1]
            finish = (
                {"type": "stop", "matched": matched}
                if gen.finish_reason == "stop"
                else {"type": "length", "length": len(generated)}
            )
            rid = rids[i] if isinstance(rids, list) else rids
            logprobs = (
                _input_logprobs(prompt, body.get("logprob_start_len", -1)) if body.get("return_logprob") else None
            )
            generated_logprobs = _output_logprobs(prompt, generated) if body.get("return_logprob") else None
            top = _top_num(body.get("top_logprobs_num"), i) if body.get("return_logprob") else 0
            tops = (
                {
                    "input_top_logprobs": _input_top_logprobs(prompt, body.get("logprob_start_len", -1), top),
                    "output_top_logprobs": [
                        _top_logprobs(prev, t, top) for prev, t in zip(prompt[-1:] + generated, generated[: len(ids)])
                    ],
                }
                if top
                else {}
            )
            outs.append(
                {
                    "text": tok.decode(generated[:-1] if matched is not None else generated, skip_special_tokens=True),
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid or uuid.uuid4().hex,
                        "finish_reason": finish,
                        "prompt_tokens": len(prompt),
                        **({"image_tokens": body["dev_image_tokens"]} if "dev_image_tokens" in body else {}),
                        "completion_tokens": len(generated),
                        "cached_tokens": 0,
                        "e2e_latency": time.time() - started,
                        "weight_version": state.config.weight_version,
                        "dev_noncanonical_splits": gen.noncanonical_splits,
                        **({"input_token_logprobs": logprobs} if logprobs is not None else {}),
                        **(
                            {"output_token_logprobs": generated_logprobs[: len(ids)]}
                            if generated_logprobs is not None
                            else {}
                        ),
                        **tops,
                    },
                }
            )
        await delivered("generate", key, request)
        if error == "malformed_json":
            return Response(json.dumps(outs)[:-7], media_type="application/json")
        return JSONResponse(outs if batch else outs[0])

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        """OpenRouter's chat completions, plain or streamed (`stream: true`: SSE, as `_sse` says).
        The history is read in OpenRouter's documented fields only (`documented_history`)."""
        try:
            body = await request.json()
        except ValueError:
            return _openrouter_error(400, "body is not JSON")
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _openrouter_error(400, "messages: expected a non-empty list")
        if body.get("model") not in (state.config.model, state.config.canonical_slug):
            return _openrouter_error(400, f"{body.get('model')} is not a valid model ID")
        thinking = (body.get("reasoning") or {}).get("enabled", True) is not False
        injected = state.config.faults("chat").inject_system_prompt  # a provider adding its own system message
        try:
            pictures = image_inputs(messages)
        except ValueError as exc:
            return _openrouter_error(400, str(exc))
        try:
            prompt = chat_prompt(
                json.dumps(
                    [
                        [{"role": "system", "content": injected}] * bool(injected)
                        + documented_history(_no_image_data(messages) if pictures else messages),
                        tools,
                        thinking,
                    ]
                )
            )
            if pictures:  # the model sees (and the provider bills) each image's media tokens
                prompt = tuple(expand_media(list(prompt), pictures, tok.convert_tokens_to_ids(MEDIA_PAD)))
        except Exception as exc:  # template errors are the client's bad request
            return _openrouter_error(400, f"chat template: {exc}")
        key = request.headers.get(SAMPLE_HEADER) or str(hash(prompt))
        stream = body.get("stream") is True
        error, rewrites, faults, latency = await admit("chat", request, key, wait=not stream)
        provider = _routed_provider(body.get("provider") or {}, state.config)
        if stream and error == "error_in_body":  # failed after the provider started: an SSE error event
            body = json.loads(_error_response(error, faults, provider, state.config.model).body)
            event = _error_event("gen-" + uuid.uuid4().hex[:24], body["error"])
            record(  # recorded, nothing billed: the provider failed before any output
                {
                    "id": event["id"],
                    "model": state.config.model,
                    "provider_name": provider,
                    "created": int(time.time()),
                },
                len(prompt),
                0,
                "error",
                cost=0.0,
            )
            return StreamingResponse(
                iter(
                    [
                        b": OPENROUTER PROCESSING\n\n",
                        b"data: " + json.dumps(event).encode() + b"\n\n",
                        b"data: [DONE]\n\n",
                    ]
                ),
                media_type="text/event-stream",
            )
        if error and error not in ("malformed_json", "empty_content", "choice_error"):
            return _error_response(error, faults, provider, state.config.model)
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or 4096
        if faults.cut_after_tool_result is not None and messages[-1].get("role") == "tool":
            max_new = min(int(max_new), faults.cut_after_tool_result)
        gen = generate_cached(
            prompt,
            int(max_new),
            float(body.get("temperature", 1.0)),
            body.get("seed"),
            request.headers.get(DATASET_HEADER),
        )
        answer = _chat_answer(
            gen, len(prompt), state.config, rewrites, empty=error == "empty_content", provider=provider, faults=faults
        )
        if error == "choice_error":
            _cut_mid_generation(answer, provider)
        # billed once the provider started, whatever the client then does; a stream that fails
        # mid-generation (`stream_error`) bills the prompt and the tokens it sent
        failing = stream and "stream_error" in rewrites
        billed = len(gen.output_ids) // 2 if failing else len(gen.output_ids)
        record(
            {
                "id": answer["id"],
                "model": answer["model"],
                "provider_name": answer["provider"],
                "created": answer["created"],
            },
            len(prompt),
            billed,
            "error" if failing else answer["choices"][0]["finish_reason"],
        )
        headers = {"X-Generation-Id": answer["id"]}
        if stream:
            return StreamingResponse(
                _stream_answer(request, key, answer, rewrites, faults, latency),
                headers=headers,
                media_type="text/event-stream",
            )
        await delivered("chat", key, request)
        if error == "malformed_json":
            return Response(
                json.dumps(answer)[: len(json.dumps(answer)) // 2], media_type="application/json", headers=headers
            )
        return JSONResponse(answer, headers=headers)

    def record(answer: dict, prompt_tokens: int, completion_tokens: int, finish: str, cost: float | None = None):
        """The generation's record (GET /v1/generation, the ledger `dev/stats` sums), in
        OpenRouter's fields."""
        state.generations[answer["id"]] = {
            "id": answer["id"],
            "model": answer["model"],
            "provider_name": answer["provider_name"],
            "total_cost": _price(prompt_tokens, completion_tokens, state.config) if cost is None else cost,
            "tokens_prompt": prompt_tokens,
            "tokens_completion": completion_tokens,
            "native_tokens_prompt": prompt_tokens,
            "native_tokens_completion": completion_tokens,
            "finish_reason": finish,
            "created_at": answer["created"],
        }
        state.recorded_at[answer["id"]] = time.monotonic()

    async def _stream_answer(request: Request, key: str, answer: dict, rewrites: set[str], faults, latency: float):
        """The answer as OpenRouter streams it: keep-alive comments while it is prepared (the
        endpoint's latency), then `_sse`'s events. `stream_cut` drops the connection after half of
        them, `stream_stall` goes silent for `stall_s` there; both are billed whole, as a provider
        that does not cancel on disconnect bills them."""
        state.stats.in_flight["chat"] += 1
        state.stats.max_in_flight["chat"] = max(state.stats.max_in_flight["chat"], state.stats.in_flight["chat"])
        try:
            waited = 0.0
            yield b": OPENROUTER PROCESSING\n\n"
            while waited < latency:
                step = min(faults.keepalive_s or latency, latency - waited)
                await asyncio.sleep(step)
                waited += step
                yield b": OPENROUTER PROCESSING\n\n"
            # the events in two writes, before and after the half where a fault strikes: one write per
            # event cost this one-process stand-in ~1 ms of CPU per answer (~60 ASGI sends), which
            # held the overflow benchmark's streamed rate below C/L (benchmarks/overflow_client.py); the
            # client reads the same bytes, in pieces as the socket gives them, whatever the writes
            events = _sse(answer)
            half = len(events) // 2
            yield b"".join(events[:half])
            if "stream_cut" in rewrites:
                state.stats.faults["chat"]["stream_cut"] += 1
                state.stats.abandoned["chat"] += 1
                raise ConnectionAbortedError("stream_cut (injected)")  # the server drops the connection
            if "stream_error" in rewrites:  # OpenRouter's mid-stream error: a data event, no usage
                state.stats.faults["chat"]["stream_error"] += 1
                error = {
                    "code": 502,
                    "message": "Provider disconnected mid-stream (injected)",
                    "metadata": {"provider_name": answer["provider"]},
                }
                yield b"data: " + json.dumps(_error_event(answer["id"], error)).encode() + b"\n\ndata: [DONE]\n\n"
                return
            if "stream_stall" in rewrites:
                state.stats.faults["chat"]["stream_stall"] += 1
                await asyncio.sleep(faults.stall_s)
            yield b"".join(events[half:])
            await delivered("chat", key, request)
        finally:
            state.stats.in_flight["chat"] -= 1

    return app


# SGLang 0.5.23's accepted sampling params, in its own order (sglang/api/v1/api_types.py):
# anything else inside `sampling_params` is a 400 with serde's `unknown field` text.
SAMPLING_FIELDS = (
    "max_new_tokens",
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
    "min_new_tokens",
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
    "choice",
)


def _pair_logprob(previous: int, token: int) -> float:
    """The dev server's stand-in model: a fixed pseudo-random log-probability per (previous id, id)."""
    import hashlib

    u = int.from_bytes(hashlib.blake2b(f"{previous}:{token}".encode(), digest_size=8).digest(), "big") / 2**64
    return -(0.05 + 6.0 * u * u)


def _output_logprobs(prompt: list[int], generated: list[int]) -> list[list]:
    """SGLang's `meta_info.output_token_logprobs` (`[logprob, id, text]` per output id), from the
    stand-in model `_pair_logprob`."""
    ids = list(prompt[-1:]) + list(generated)
    return [[_pair_logprob(ids[i], ids[i + 1]), ids[i + 1], None] for i in range(len(generated))]


def _input_logprobs(prompt: list[int], start: int) -> list[list]:
    """SGLang's `meta_info.input_token_logprobs` from `logprob_start_len` (`[logprob, id, text]`,
    the first entry's logprob None). The values are the dev server's own stand-in model: a fixed
    pseudo-random log-probability per (previous id, id), the same for every text whatever path it
    came by, so local and overflow text of one dev server score alike; a real engine's are the
    model's (tests/engine/test_policy_check.py)."""
    start = max(start, 0)
    return [
        [None if i == start else _pair_logprob(prompt[i - 1], prompt[i]), prompt[i], None]
        for i in range(start, len(prompt))
    ]


def _top_logprobs(previous: int, token: int, k: int) -> list[list]:
    """One position's `k` likeliest ids as SGLang lists them (`[logprob, id, text]`, descending),
    from the stand-in model: its own text is its likeliest, so `token` comes first with its
    `_pair_logprob`, and the other ids (pseudo-random per (previous id, rank)) share, at most, half
    of what is left, each below it. The values are log-probabilities of one distribution (they
    sum below 1); a token of the stand-in's text is never outside a nucleus."""
    import hashlib

    from eagle3_data.builds.kimi_tokenizer import NUM_BPE_RANKS  # the ordinary (non-special) ids

    own = _pair_logprob(previous, token)
    share = min(math.exp(own), 1.0 - math.exp(own))  # every other id below `token`, and all of them below 1
    out, taken = [[own, token, None]], {token}
    for rank in range(1, k):
        digest = hashlib.blake2b(f"{previous}:top:{rank}".encode(), digest_size=8).digest()
        other = int.from_bytes(digest, "big") % NUM_BPE_RANKS
        while other in taken:
            other = (other + 1) % NUM_BPE_RANKS
        taken.add(other)
        out.append([math.log(share / (2 * (rank + 1) ** 2)), other, None])
    return out


def _input_top_logprobs(prompt: list[int], start: int, k: int) -> list[list | None]:
    """SGLang's `meta_info.input_top_logprobs`: lined up with `input_token_logprobs` (None at
    `logprob_start_len`, then each position's `_top_logprobs`)."""
    start = max(start, 0)
    return [None if i == start else _top_logprobs(prompt[i - 1], prompt[i], k) for i in range(start, len(prompt))]


def _top_num(value, i: int) -> int:
    """`top_logprobs_num` for the batch's i-th prompt (an int, or one per prompt; absent: 0)."""
    if isinstance(value, list):
        return int(value[i]) if i < len(value) else 0
    return int(value or 0)


def _generate_contract_error(body) -> str | None:
    """The schema checks of SGLang's `generate_contract_error` that a client can trip: the body
    shape, `input_ids` as ints or lists of ints, and `sampling_params` keys and int fields."""
    if not isinstance(body, dict):
        return (
            "invalid type: sequence, expected struct GenerateRequest"
            if isinstance(body, list)
            else "invalid type, expected struct GenerateRequest"
        )
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list):
            return f"invalid type: {_unexpected(ids)}, expected a value or an array of values for TokenIdsOrList"
        number = bool(ids) and isinstance(ids[0], (int, float)) and not isinstance(ids[0], bool)
        rows = [ids] if not ids or number else ids  # [] and [scalar, ...] are one list; else a batch
        for row in rows:
            if not isinstance(row, list):
                return f"invalid type: {_unexpected(row)}, expected a sequence"
            for t in row:
                if not (isinstance(t, int) and not isinstance(t, bool)):
                    return f"invalid type: {_unexpected(t)}, expected i64"
    top = body.get("top_logprobs_num")  # Int64OrList (sglang/api/v1/api_types.py:1009 decode_Int64OrList)
    if top is not None:
        for v in top if isinstance(top, list) else [top]:
            if not (isinstance(v, int) and not isinstance(v, bool)):
                what = "i64" if isinstance(top, list) else "a value or an array of values for Int64OrList"
                return f"invalid type: {_unexpected(v)}, expected {what}"
    sp = body.get("sampling_params")
    if sp is not None:
        if not isinstance(sp, dict):
            return f"invalid type: {_unexpected(sp)}, expected struct SamplingParams"
        for key, value in sp.items():
            if key not in SAMPLING_FIELDS:
                listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
                return f"unknown field `{key}`, expected one of {listed}"
            if (
                key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")
                and value is not None
                and not (isinstance(value, int) and not isinstance(value, bool))
            ):
                return f"invalid type: {_unexpected(value)}, expected i64"
    return None


def _unexpected(v) -> str:
    """serde's `Unexpected` display, as SGLang's contract errors print it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _generate_prompts(body: dict, tok) -> tuple[bool, list[list[int]] | None]:
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        if ids and isinstance(ids[0], list):
            return True, ids
        return False, [ids]
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        return isinstance(text, list), [tok.encode(t, add_special_tokens=False) for t in texts]
    return False, None


def _price(prompt_tokens: int, completion_tokens: int, config: ServerConfig) -> float:
    price = config.price_per_token
    return round(prompt_tokens * float(price["prompt"]) + completion_tokens * float(price["completion"]), 10)


def _routed_provider(routing: dict, config: ServerConfig) -> str:
    """The display name of the provider OpenRouter would route to: the first of the pin's
    `only` or `order` slugs (by the provider table), else the server's `provider`."""
    names = {p["slug"]: p["name"] for p in config.providers}
    for slug in routing.get("only") or routing.get("order") or []:
        if slug.split("/")[0] in names:
            return names[slug.split("/")[0]]
    return config.provider


def _chat_answer(
    gen: Generation, prompt_tokens: int, config: ServerConfig, rewrites: set[str], empty: bool, provider: str, faults
) -> dict:
    reasoning, content, calls = (
        gen.reasoning,
        gen.content,
        [dict(c, function=dict(c["function"])) for c in gen.tool_calls],
    )
    if "trim_whitespace" in rewrites:
        reasoning = reasoning.strip() if reasoning else reasoning
        content = content.strip()
    if "rewrite_tool_call_ids" in rewrites:
        for c in calls:
            c["id"] = "call_" + uuid.uuid5(uuid.NAMESPACE_OID, c["id"] + c["function"]["arguments"]).hex[:24]
    if "reserialize_arguments" in rewrites:
        for c in calls:
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
    if "object_arguments" in rewrites:
        for c in calls:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if empty:
        reasoning, content, calls = None, "", []
    finish = "length" if gen.finish_reason == "length" else ("tool_calls" if calls else "stop")
    completion = len(gen.output_ids)
    message = {"role": "assistant", "content": content, "refusal": None, "reasoning": reasoning or None}
    if reasoning and "encrypted_reasoning" in rewrites:
        message["reasoning"] = None
        message["reasoning_details"] = [
            {"type": "reasoning.encrypted", "data": uuid.uuid4().hex * 4, "id": None, "format": "unknown", "index": 0}
        ]
    elif reasoning and "reasoning_details_only" in rewrites:
        message["reasoning"] = None
        half = len(reasoning) // 2  # two entries, listed out of order: the reader orders by index
        message["reasoning_details"] = [
            {"type": "reasoning.text", "text": reasoning[half:], "signature": None, "format": "unknown", "index": 1},
            {"type": "reasoning.text", "text": reasoning[:half], "signature": None, "format": "unknown", "index": 0},
        ]
    if calls:
        message["tool_calls"] = calls
    answer = {
        "id": "gen-" + uuid.uuid4().hex[:24],
        "provider": faults.other_provider if "wrong_provider" in rewrites else provider,
        "model": faults.other_model
        if "wrong_model" in rewrites
        else (config.canonical_slug if config.answer_canonical_slug else config.model),
        "object": "chat.completion",
        "created": int(time.time()),
        "choices": [
            {"index": 0, "logprobs": None, "finish_reason": finish, "native_finish_reason": finish, "message": message}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "cost": _price(prompt_tokens, completion, config),
            "is_byok": False,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
            "cost_details": {
                "upstream_inference_prompt_cost": _price(prompt_tokens, 0, config),
                "upstream_inference_completions_cost": _price(0, completion, config),
            },
        },
    }
    if "omit_cost" in rewrites:
        del answer["usage"]["cost"]
    return answer


def image_inputs(messages: list[dict]) -> list[dict]:
    """The images of a chat request's `image_url` parts, as OpenRouter takes them: each part's
    `image_url.url` a base64 data URI of an image (this server fetches no https URL); a malformed
    part is the client's error (ValueError naming it). Returns {"media_tokens"} per image, in order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}].image_url"
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else None
            if not isinstance(url, str):
                raise ValueError(f"{where}: expected an object with a string `url`")
            if url.startswith(("http://", "https://")):
                raise ValueError(f"{where}.url: the dev server does not fetch image URLs: send a data URI")
            out.append({"media_tokens": media_tokens(*_data_uri_size(url, f"{where}.url"))})
    return out


def _data_uri_size(url, where: str) -> tuple[int, int]:
    """(width, height) of an image sent as a base64 data URI, the only form this server takes
    (it fetches no URL or path); ValueError naming `where` otherwise."""
    head, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ValueError(f"{where}: expected data:image/<type>;base64,<data> (the dev server takes data URIs only)")
    try:
        _, width, height = probe(base64.b64decode(data, validate=True))
    except (binascii.Error, ImageError) as exc:
        raise ValueError(f"{where}: not a readable image ({exc})") from None
    return width, height


def _with_images(prompts: list[list[int]], image_data, tok, drift: int) -> tuple[list[int], int]:
    """One `/generate` prompt with its `image_data` as SGLang's Kimi-K2.5 processor takes them
    (srt/multimodal/processors/kimi_k25.py): exactly one `<|media_pad|>` per image, each expanded
    here to the image's media tokens (+ `drift`: a server whose processor counts otherwise). An
    image is a base64 data URI (SGLang also takes URLs and paths; this server fetches none).
    Returns the expanded ids and their image tokens (SGLang's `meta_info.image_tokens`)."""
    if len(prompts) != 1:
        raise ValueError("the dev server takes image_data with a single prompt")
    images = image_data if isinstance(image_data, list) else [image_data]
    pad = tok.convert_tokens_to_ids(MEDIA_PAD)
    found = sum(1 for t in prompts[0] if t == pad)
    if found != len(images):
        raise ValueError(
            f"Kimi image placeholders must map one-to-one to image data: expected {len(images)}, found {found} token(s)"
        )
    refs = []
    for k, url in enumerate(images):
        refs.append({"media_tokens": media_tokens(*_data_uri_size(url, f"image_data[{k}]")) + drift})
    return expand_media(list(prompts[0]), refs, pad), sum(r["media_tokens"] for r in refs)


def _no_image_data(messages: list[dict]) -> list[dict]:
    """The messages with each image part's data left out (the template renders a placeholder for
    it; the data would only bloat the render cache's keys)."""
    return [
        {
            **m,
            "content": [
                {"type": "image_url"} if isinstance(p, dict) and p.get("type") == "image_url" else p
                for p in m["content"]
            ],
        }
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def documented_history(messages: list[dict]) -> list[dict]:
    """The history as OpenRouter reads it: an assistant turn's reasoning from its documented fields,
    `reasoning` (text) or the text of its `reasoning_details`, handed to the chat template (which
    calls it `reasoning_content`); a `reasoning_content` field, which OpenRouter does not
    document, is dropped, as a provider that reads only the documented fields drops it."""
    return [_documented_turn(m) if m.get("role") == "assistant" else m for m in messages]


def _documented_turn(m: dict) -> dict:
    reasoning = m.get("reasoning")
    if reasoning is None:
        details = [d for d in m.get("reasoning_details") or () if isinstance(d, dict)]
        texts = sorted((d for d in details if d.get("type") == "reasoning.text"), key=lambda d: d.get("index") or 0)
        reasoning = "".join(d.get("text") or "" for d in texts) or None
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning", "reasoning_details")}
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    return out


def _sse(answer: dict) -> list[bytes]:
    """A non-streamed answer as OpenRouter's SSE events: a role chunk, the reasoning, content and
    tool-call deltas in pieces (each call's id and name first, its arguments after), a last chunk
    with the finish reason (and, for a provider failing mid-generation, the `error`), a usage
    chunk with no choices, then `data: [DONE]`."""
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "provider", "model", "object", "created")} | {
        "object": "chat.completion.chunk"
    }

    # json.dumps(dict(head, choices=[...])) of every event, with the head serialised once: the
    # same bytes at a fraction of the server's CPU per answer (~60 events)
    prefix = ("data: " + json.dumps(head)[:-1] + ', "choices": [{"index": 0, "delta": ').encode()
    suffix = b', "finish_reason": null, "native_finish_reason": null, "logprobs": null}]}\n\n'

    def event(delta: dict | None = None) -> bytes:
        return prefix + json.dumps(delta or {}).encode() + suffix

    def pieces(text: str, size: int = 7) -> list[str]:
        return [text[i : i + size] for i in range(0, len(text), size)]

    events = [event({"role": "assistant", "content": ""})]
    events += [
        event({"role": "assistant", "content": "", "reasoning": t}) for t in pieces(message.get("reasoning") or "")
    ]
    for d in message.get("reasoning_details") or ():
        events.append(event({"role": "assistant", "content": "", "reasoning_details": [d]}))
    events += [event({"role": "assistant", "content": t}) for t in pieces(message.get("content") or "")]
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn, args = call["function"], call["function"]["arguments"]
        events.append(
            event(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ],
                }
            )
        )
        parts = pieces(args) if isinstance(args, str) else [args]
        events += [
            event({"role": "assistant", "content": None, "tool_calls": [{"index": i, "function": {"arguments": part}}]})
            for part in parts
        ]
    last = json.loads(event()[6:])
    last["choices"][0].update(
        finish_reason=choice["finish_reason"], native_finish_reason=choice["native_finish_reason"]
    )
    if choice.get("error"):
        last["error"] = choice["error"]
    events.append(b"data: " + json.dumps(last).encode() + b"\n\n")
    events.append(b"data: " + json.dumps(dict(head, choices=[], usage=answer["usage"])).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _error_event(generation_id: str, error: dict) -> dict:
    """OpenRouter's SSE data event for an error after the stream opened (errors-and-debugging:
    "Error During Streaming"): the error, and the choice finished with `error`."""
    return {
        "id": generation_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "error": error,
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
    }


def _cut_mid_generation(answer: dict, provider: str) -> None:
    """OpenRouter's non-streaming shape for a provider that failed after generation started:
    the partial text, `finish_reason: "error"` and the error inside the choice (billed)."""
    choice = answer["choices"][0]
    message = choice["message"]
    message["content"] = (message.get("content") or "")[: len(message.get("content") or "") // 2]
    message.pop("tool_calls", None)
    choice.update(
        finish_reason="error",
        native_finish_reason="error",
        error={
            "code": 502,
            "message": "Provider disconnected mid-stream",
            "metadata": {"error_type": "provider_unavailable", "provider_name": provider},
        },
    )


def _openrouter_error(
    code: int, message: str, headers: dict | None = None, metadata: dict | None = None, status: int | None = None
) -> JSONResponse:
    """OpenRouter's error body; `status` differs from `code` only for errors raised once a
    provider had started (HTTP 200, the error in the body)."""
    return JSONResponse(
        {"error": {"code": code, "message": message, "metadata": metadata or {}}, "user_id": "user_dev"},
        status_code=status or code,
        headers=headers,
    )


def _error_response(error: str, faults, provider: str = "", model: str = "") -> Response:
    """The bodies OpenRouter answers (errors-and-debugging.mdx; bodies recorded from the service)."""
    if error == "rate_limit":
        return _openrouter_error(
            429,
            "Rate limit exceeded (injected)",
            {"Retry-After": str(faults.retry_after_s)},
            {"error_type": "rate_limit_exceeded"},
        )
    if error == "credits":
        return _openrouter_error(
            402,
            "Insufficient credits. Add more using https://openrouter.ai/credits (injected)",
            metadata={"error_type": "payment_required"},
        )
    if error == "in_flight_402":
        hint = str(faults.retry_after_s)
        return _openrouter_error(
            402,
            "This request would exceed your available credits given your current in-flight requests. Retry "
            "after in-flight requests settle, or add credits.",
            {"Retry-After": hint},
            {
                "reason": "in_flight_budget_exhausted",
                "limit_source": "openrouter_in_flight_budget",
                "remedy_hint": "Retry after your in-flight requests settle (see the Retry-After header).",
                "headers": {"Retry-After": hint},
            },
        )
    if error == "forbidden":
        return _openrouter_error(
            403, "Key limit exceeded (total limit). Manage it using https://openrouter.ai/settings/keys"
        )
    if error == "moderation":
        return _openrouter_error(
            403,
            f'{model} requires moderation on {provider}. Your input was flagged for "harassment"',
            metadata={
                "reasons": ["harassment"],
                "flagged_input": "...",
                "provider_name": provider,
                "model_slug": model,
            },
        )
    if error == "bad_request":
        return _openrouter_error(400, "Provider rejected the request (injected)")
    if error == "server_error":
        return _openrouter_error(502, "Provider returned error (injected)", metadata={"provider_name": provider})
    if error == "error_in_body":
        return _openrouter_error(
            502,
            "Provider returned error",
            metadata={"provider_name": provider, "raw": "upstream connection reset (injected)"},
            status=200,
        )
    return _openrouter_error(500, f"unknown fault {error}")


def serve(tokenizer_dir: str | Path, port: int, config: ServerConfig | None = None, host: str = "127.0.0.1") -> None:
    """Run until killed; one process, one event loop (latency is asyncio sleep, not CPU)."""
    import uvicorn

    uvicorn.run(
        create_app(tokenizer_dir, config),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=60,
    )


class DevServerProcess:
    """The dev server as a child process on a free 127.0.0.1 port; `stop()` kills it by PID."""

    def __init__(
        self,
        tokenizer_dir: str | Path,
        config_path: str | Path | None = None,
        log_path: str | Path | None = None,
        # a bound, not a pace: a server that dies fails at once (wait_http_ok), while one niced under a
        # saturated machine (the benchmark smokes beside make test's tiers) may take minutes to answer
        startup_timeout_s: float = 600.0,
        *,
        pipeline_config: str | Path | None = None,
    ):
        import os
        import subprocess
        import sys

        from eagle3_data.dev.processes import free_port, wait_http_ok

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-c",
            "from eagle3_data.cli import main; raise SystemExit(main())",
            "dev",
            "serve",
            "--port",
            str(self.port),
            "--tokenizer",
            str(tokenizer_dir),
        ]
        if config_path:
            cmd += ["--config", str(config_path)]
        if pipeline_config:
            cmd += ["--pipeline-config", str(pipeline_config)]
        self._log = open(log_path or os.devnull, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_http_ok(f"{self.url}/health", [self.proc], "dev inference server", log_path, startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict:
        from eagle3_data.dev.processes import local_http

        return local_http().get(f"{self.url}/dev/stats", timeout=30).json()

    def configure(self, config: dict) -> None:
        """Replace the running server's config (YAML keys) and reset its counters."""
        from eagle3_data.dev.processes import local_http

        r = local_http().post(f"{self.url}/dev/config", json=config, timeout=30)
        if r.status_code != 200:
            raise ValueError(r.text)

    def stop(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()
