"""The dev server composed: its routes by job (engine_info, generate, openrouter, control) over one
shared state, behind SGLang's API-key check when it is given one (`auth`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI

from eagle3_data.dev.faults import ServerConfig
from eagle3_data.dev.inference_server.auth import ApiKeyCheck
from eagle3_data.dev.inference_server.control import add_routes as add_control_routes
from eagle3_data.dev.inference_server.engine_info import add_routes as add_engine_info_routes
from eagle3_data.dev.inference_server.generate import add_routes as add_generate_routes
from eagle3_data.dev.inference_server.openrouter import add_routes as add_openrouter_routes
from eagle3_data.dev.inference_server.state import ServerState


def create_app(tokenizer: Any, config: ServerConfig | None = None, *, api_key: str | None = None) -> FastAPI:
    """`tokenizer`: a loaded HF tokenizer or its directory; `api_key`: require it as SGLang's
    `--api-key` does (`auth.ApiKeyCheck`), None: every route is open."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    state = ServerState(tokenizer, config or ServerConfig())
    app = FastAPI(title="eagle3-data dev inference server")
    for add_routes in (add_engine_info_routes, add_openrouter_routes, add_control_routes, add_generate_routes):
        add_routes(app, state)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    return app


def serve(
    tokenizer_dir: str | Path,
    port: int,
    config: ServerConfig | None = None,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
) -> None:
    """Run until killed; one process, one event loop (latency is asyncio sleep, not CPU)."""
    import uvicorn

    uvicorn.run(
        create_app(tokenizer_dir, config, api_key=api_key),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=60,
    )
