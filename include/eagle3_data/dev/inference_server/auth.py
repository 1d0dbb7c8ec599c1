"""SGLang's `--api-key` check, as SGLang 0.5.23 applies it (`sglang/srt/utils/auth.py`:
`add_api_key_middleware`, installed by `entrypoints/http_server.py` when the server has a key, and
`decide_request_auth` for routes of auth level NORMAL, the level of every route this server
stands in for): an OPTIONS request and any path under `/health`, `/ready` or `/metrics` pass
without a key; any other request must carry `Authorization: Bearer <key>` (the scheme in any
case, the rest after the first space compared to the key in constant time), else it is answered
401 `{"error":"Unauthorized"}` (JSON), whatever the route or method, before the route runs.

The dev server's own `/dev/` routes pass too: no real engine has them, and the tests reach them
with the plain HTTP client they read the stats with."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/dev/")


def authorized(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `api_key` as SGLang reads it: split at the first
    space into a scheme (`bearer`, any case) and the key, compared in constant time."""
    if not authorization:
        return False
    scheme, space, token = authorization.partition(" ")
    return bool(space) and scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


class ApiKeyCheck:
    """Plain ASGI, as SGLang's is, not `BaseHTTPMiddleware`: the streamed answers and
    `Request.is_disconnected` (which tells an abandoned answer from a delivered one) see the
    client's own events."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if not authorized(header, self.api_key):
            return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)
