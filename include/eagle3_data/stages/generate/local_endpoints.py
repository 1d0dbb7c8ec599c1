"""The local stage's endpoints: which are usable, what each serves and takes, drop and re-admit.

`/health` answers 503 while a server warms up: endpoints are polled concurrently until ready or
`warmup_timeout_s`; one that accepts no connection for `unreachable_timeout_s` is named dead at
once. One is dropped after `max_endpoint_failures` consecutive failures and re-admitted when its
`/health` answers again. In flight per endpoint: `in_flight_per_endpoint` when set; else what the
endpoint reports as its capacity (SGLang's `max_running_requests`), else DEFAULT_IN_FLIGHT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from eagle3_data.config import LocalGenerationConfig
from eagle3_data.engines.client import (
    DEFAULT_IN_FLIGHT,
    MAX_IN_FLIGHT,
    Wire,
    health,
    server_capacity,
    wait_healthy,
)
from eagle3_data.errors import EndpointUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthWait:
    """The timings of an endpoint's `/health` wait (`engines.client.HealthTimings`): the config's
    bounds and the client's poll interval."""

    config: LocalGenerationConfig
    health_interval_s: float

    @property
    def connect_timeout_s(self) -> float:
        return self.config.connect_timeout_s

    @property
    def unreachable_timeout_s(self) -> float:
        return self.config.unreachable_timeout_s

    @property
    def warmup_timeout_s(self) -> float:
        return self.config.warmup_timeout_s


class EndpointPool:
    """Every endpoint's state: what it serves (`identity`), how many requests it takes
    (`capacity`, `capacity_source`), its consecutive failures and, while admitted, its workers."""

    def __init__(self, endpoints: Sequence[str], wire: Wire, config: LocalGenerationConfig, health_wait: HealthWait):
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.wire, self.config, self.health_wait = wire, config, health_wait
        self.identity: dict[str, dict[str, Any]] = {}
        self.capacity: dict[str, int] = {}  # workers per endpoint
        self.capacity_source: dict[str, str] = {}  # "config" | "server_info" | "default"
        self.failures = dict.fromkeys(self.endpoints, 0)  # consecutive, per endpoint
        self.busy = dict.fromkeys(self.endpoints, 0)
        self.max_in_flight = dict.fromkeys(self.endpoints, 0)
        self.workers: dict[str, list[asyncio.Task[None]]] = {}
        self.http: aiohttp.ClientSession | None = None  # one pass's session

    @property
    def _session(self) -> aiohttp.ClientSession:
        """The pass's session (set while a pass runs)."""
        assert self.http is not None, "used outside a pass"
        return self.http

    async def usable(self, http: aiohttp.ClientSession) -> list[str]:
        """The endpoints ready for this pass; EndpointUnavailable (naming each one's problem) when none is."""
        self.http = http
        engine = self.wire.engine
        log.info(
            "%s: waiting for %d endpoint(s) to answer /health: %s",
            engine,
            len(self.endpoints),
            ", ".join(self.endpoints),
        )
        problems = await asyncio.gather(*(self._wait_ready(e) for e in self.endpoints))
        for endpoint, problem in zip(self.endpoints, problems):
            if problem is not None:
                log.warning("%s endpoint %s: %s; not used", engine, endpoint, problem)
        healthy = [e for e, problem in zip(self.endpoints, problems) if problem is None]
        if not healthy:
            raise EndpointUnavailable(
                f"no {engine} endpoint is usable: "
                + "; ".join(f"{e}: {problem}" for e, problem in zip(self.endpoints, problems))
                + ". Check the URLs (the local engine's connection, sglang_default, or --endpoint) and that the "
                "servers run; a server still loading its model that does not listen yet: raise "
                "generation.local.unreachable_timeout_s"
            )
        return healthy

    async def _wait_ready(self, endpoint: str) -> str | None:
        """`wait_healthy`, then what the endpoint serves and takes (`_ready`)."""
        problem = await wait_healthy(self._session, endpoint, self.wire.engine, self.health_wait)
        return problem if problem is not None else await self._ready(endpoint)

    async def _ready(self, endpoint: str) -> str | None:
        """An endpoint just became healthy: what it serves (None, or why it is not used: another
        model than `served_model`), and how many requests it takes."""
        self.identity[endpoint] = identity = await self.wire.identify(self._session, endpoint)
        served = self.config.served_model
        if served is not None and identity.get("served_model") != served:
            return (
                f"serves {identity.get('served_model')!r} (GET /v1/models), not generation.local.served_model "
                f"{served!r}"
            )
        await self._size(endpoint)
        return None

    async def _size(self, endpoint: str) -> None:
        """Workers for `endpoint`: the configured override, else its reported capacity, else the default."""
        if self.config.in_flight_per_endpoint is not None:
            self.capacity[endpoint], self.capacity_source[endpoint] = self.config.in_flight_per_endpoint, "config"
            return
        reported = await self._reported_capacity(endpoint)
        if reported is None:
            self.capacity[endpoint], self.capacity_source[endpoint] = DEFAULT_IN_FLIGHT, "default"
        else:
            self.capacity[endpoint], self.capacity_source[endpoint] = min(reported, MAX_IN_FLIGHT), "server_info"
        log.info(
            "%s endpoint %s: %d in flight (%s)",
            self.wire.engine,
            endpoint,
            self.capacity[endpoint],
            "its max_running_requests"
            if reported is not None
            else "default: it reports no capacity; set generation.local.in_flight_per_endpoint",
        )

    async def _reported_capacity(self, endpoint: str) -> int | None:
        for path in self.wire.capacity_paths:
            try:
                async with self._session.get(f"{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
                    if r.status != 200:
                        continue
                    info = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            return server_capacity(info)
        return None

    def admit(self, endpoint: str, worker: Callable[[str], asyncio.Task[None]]) -> None:
        """Start `endpoint`'s workers, one per request it takes."""
        self.failures[endpoint] = 0
        count = self.capacity.get(endpoint, self.config.in_flight_per_endpoint or DEFAULT_IN_FLIGHT)
        self.workers[endpoint] = [worker(endpoint) for _ in range(count)]

    def count(self, endpoint: str, failed: bool) -> bool:
        """One request's outcome on `endpoint`; True when its failures in a row reach
        `max_endpoint_failures` (it should be dropped)."""
        self.failures[endpoint] = self.failures[endpoint] + 1 if failed else 0
        return self.failures[endpoint] >= self.config.max_endpoint_failures

    def drop(self, endpoint: str) -> None:
        """After `max_endpoint_failures` consecutive failures: its workers stop (their prompts go
        back on the queue) and `readmit` watches its /health."""
        if endpoint not in self.workers:
            return
        log.warning(
            "%s endpoint %s: %d consecutive failures; dropped until /health answers again",
            self.wire.engine,
            endpoint,
            self.failures[endpoint],
        )
        current = asyncio.current_task()
        for task in self.workers.pop(endpoint):
            if task is not current:
                task.cancel()

    async def readmit(self, worker: Callable[[str], asyncio.Task[None]]) -> str:
        """Re-admit dropped endpoints that come back; returns (why the stage stops) when none is
        left for a warm-up."""
        alone_since = None
        while True:
            await asyncio.sleep(self.health_wait.health_interval_s)
            for endpoint in [e for e in self.endpoints if e not in self.workers]:
                if await health(self._session, endpoint, self.config.connect_timeout_s) == 200:
                    if (problem := await self._ready(endpoint)) is not None:
                        log.warning(
                            "%s endpoint %s: healthy again but %s; not used", self.wire.engine, endpoint, problem
                        )
                        continue
                    log.info("%s endpoint %s: healthy again; re-admitted", self.wire.engine, endpoint)
                    self.admit(endpoint, worker)
            if self.workers:
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since > self.config.warmup_timeout_s:
                return (
                    f"every {self.wire.engine} endpoint failed and none came back within "
                    f"{self.config.warmup_timeout_s:g} s"
                )

    def workers_running(self) -> list[asyncio.Task[None]]:
        return [task for tasks in self.workers.values() for task in tasks]

    def timing(self) -> dict[str, Any]:
        """In flight per endpoint and where that came from."""
        return {"in_flight": dict(self.capacity), "in_flight_source": dict(self.capacity_source)}
