"""SGLang's native `/generate`, protocol-true: what SGLang 0.5.23 rejects it rejects, in its
shapes; its answers carry the ids, finish reasons and log-probabilities SGLang's do."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from eagle3_data.dev.inference_server.logprobs import (
    input_logprobs,
    input_top_logprobs,
    output_logprobs,
    top_logprobs,
    top_num,
)
from eagle3_data.dev.inference_server.media import with_images
from eagle3_data.dev.inference_server.openrouter_answers import error_response
from eagle3_data.dev.inference_server.sglang_contract import generate_contract_error
from eagle3_data.dev.inference_server.state import DATASET_HEADER, SAMPLE_HEADER, ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    tok, admit, delivered, generate_cached, unavailable = (
        state.tok,
        state.admit,
        state.delivered,
        state.generate_cached,
        state.unavailable,
    )

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
        problem = generate_contract_error(body)
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
                expanded, image_tokens = with_images(prompts, body["image_data"], tok, state.config.media_token_drift)
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

    async def _answer_generate(
        request: Request, body: dict[str, Any], batch: bool, prompts: list[list[int]], sp: dict[str, Any], rids: Any
    ) -> Response:
        key = request.headers.get(SAMPLE_HEADER) or (json.dumps(rids) if rids else str(hash(tuple(prompts[0]))))
        error, _, faults, _ = await admit("generate", request, key)
        if error == "queue_full":  # SGLang's HTTPException handler: an ErrorResponse body
            return JSONResponse(
                {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503},
                status_code=503,
            )
        if error and error not in ("malformed_json", "empty_content"):
            return error_response(error, faults)
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
            logprobs = input_logprobs(prompt, body.get("logprob_start_len", -1)) if body.get("return_logprob") else None
            generated_logprobs = output_logprobs(prompt, generated) if body.get("return_logprob") else None
            top = top_num(body.get("top_logprobs_num"), i) if body.get("return_logprob") else 0
            tops = (
                {
                    "input_top_logprobs": input_top_logprobs(
                        prompt, body.get("logprob_start_len", -1), top, state.ordinary_ids
                    ),
                    "output_top_logprobs": [
                        top_logprobs(prev, t, top, state.ordinary_ids)
                        for prev, t in zip(prompt[-1:] + generated, generated[: len(ids)])
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


def _generate_prompts(body: dict[str, Any], tok: Any) -> tuple[bool, list[list[int]] | None]:
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        if ids and isinstance(ids[0], list):
            return True, ids
        return False, [ids]
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        return isinstance(text, list), [tok.encode(t, add_special_tokens=False) for t in texts]
    return False, None
