"""A provider that misbehaves the way real ones do, in front of a real `vllm serve`.

The policy check (eagle3_data.stages.policy) must fail a provider that serves the target's name but not
its policy. To measure that on CPU the "provider" is the tiny target itself behind this proxy,
which forwards every request byte for byte (the chat route, plain or streamed; /models; anything
else) and rewrites only the sampling fields of a chat-completions body, as a provider that
ignores them would:

- `temperature_factor`: samples at another temperature than asked (1.3: 1.3 when asked 1.0);
- `ignore`: fields it drops (`top_p`: samples from the full distribution).

An honest provider is the proxy with no rewrite. Serving other weights needs another engine
(`eagle3_devtools.int8_model` builds an int8-rounded copy of a checkpoint). Bound to 127.0.0.1
on a free port, served from a background thread with its own event loop; `stop()` ends it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from eagle3_data.dev.processes import free_port

CHAT_PATH = "/chat/completions"
# hop-by-hop or body-encoding headers the proxy's own server sets for the body it sends
_DROPPED = {"host", "content-length", "transfer-encoding", "content-encoding", "connection", "keep-alive"}


@dataclass(frozen=True)
class Rewrite:
    """What the provider does to the sampling it is asked for."""

    temperature_factor: float = 1.0
    ignore: tuple[str, ...] = ()

    def apply(self, body: dict) -> dict:
        out = {k: v for k, v in body.items() if k not in self.ignore}
        if self.temperature_factor != 1.0 and out.get("temperature") is not None:
            out["temperature"] = out["temperature"] * self.temperature_factor
        return out


@dataclass
class ProviderProxy:
    url: str  # http://127.0.0.1:PORT, no /v1
    rewrite: Rewrite
    upstream: str
    rewritten: int = 0  # chat requests whose body was rewritten (what the test checks the fault was applied to)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def start_provider_proxy(upstream: str, rewrite: Rewrite = Rewrite()) -> ProviderProxy:
    """Serve the proxy to `upstream` (http://host:port, no /v1) and return once it listens."""
    proxy = ProviderProxy(f"http://127.0.0.1:{free_port()}", rewrite, upstream.rstrip("/"))
    ready = threading.Event()
    failed: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(_serve(proxy, ready))
        except BaseException as exc:
            failed.append(exc)
            ready.set()

    proxy._thread = threading.Thread(target=main, name="provider-proxy", daemon=True)
    proxy._thread.start()
    ready.wait(30)
    if failed or not ready.is_set():
        raise RuntimeError(f"provider proxy did not start: {failed[0] if failed else 'timeout'}")
    return proxy


async def _serve(proxy: ProviderProxy, ready: threading.Event) -> None:
    import aiohttp
    from aiohttp import web

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if request.method == "POST" and request.path.endswith(CHAT_PATH):
                new = proxy.rewrite.apply(json.loads(body))
                if new != json.loads(body):
                    proxy.rewritten += 1
                body = json.dumps(new).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
            async with http.request(
                request.method, proxy.upstream + request.path_qs, data=body or None, headers=headers
            ) as up:
                out = web.StreamResponse(
                    status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _DROPPED}
                )
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(proxy.url.rsplit(":", 1)[1])).start()
        ready.set()
        try:
            while not proxy._stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()
