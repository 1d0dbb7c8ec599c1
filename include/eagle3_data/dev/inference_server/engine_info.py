"""The routes a client reads an engine by: `/health` (readiness), SGLang's model and server info,
and the OpenAI-compatible model list (served by OpenRouter, vLLM and SGLang alike)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response

from eagle3_data.dev.inference_server.state import ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    tok, unavailable = state.tok, state.unavailable

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        """SGLang answers 503 while warming up (its /health runs a one-token generation)."""
        return Response(status_code=503 if unavailable() else 200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
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

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated name, still served by SGLang 0.5.23
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": state.config.model,
            "tokenizer_path": str(tok.name_or_path),
            "is_generation": True,
            "weight_version": state.config.weight_version,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated name, still served by SGLang 0.5.23
    async def server_info() -> dict[str, Any]:
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
