"""The dev server's own routes, which no real engine has: the counters tests read (`/dev/stats`)
and the config they replace (`/dev/config`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from eagle3_data.dev.inference_server.state import ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/dev/stats")
    async def dev_stats() -> dict[str, Any]:
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
        state.reset(new)  # clears the generation cache too
        return JSONResponse({"ok": True})
