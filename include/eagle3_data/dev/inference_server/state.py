"""What every route of the dev server shares: the config, the generator, the counters, and the
admission every billed request goes through (faults, latency, credits)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from functools import lru_cache
from typing import Any

from fastapi import Request

from eagle3_data.chat_format import get_output_format
from eagle3_data.dev.faults import EndpointFaults, ServerConfig
from eagle3_data.dev.inference_server.logprobs import ordinary_id_count
from eagle3_data.dev.text_model import DevTextModel, Generation

DATASET_HEADER = "x-eagle3-dataset"
SAMPLE_HEADER = "x-eagle3-sample-id"


class Stats:
    """Per-endpoint counters: requests and answered (billed) generations per sample key."""

    def __init__(self) -> None:
        self.requests: dict[str, Counter[str]] = defaultdict(Counter)
        self.answered: dict[str, Counter[str]] = defaultdict(Counter)
        self.faults: dict[str, Counter[str]] = defaultdict(Counter)
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.total_answered: Counter[str] = Counter()
        self.abandoned: Counter[str] = Counter()

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": {k: dict(v) for k, v in self.requests.items()},
            "answered": {k: dict(v) for k, v in self.answered.items()},
            "faults": {k: dict(v) for k, v in self.faults.items()},
            "max_in_flight": dict(self.max_in_flight),
            "total_answered": dict(self.total_answered),
            "abandoned": dict(self.abandoned),
        }


class ServerState:
    """One server's state; `reset` (`POST /dev/config`) replaces the config, the generator's
    rates and the counters, and keeps the tokenizer and the chat-template render cache."""

    model: DevTextModel  # made by the first `reset`, kept by the next ones

    def __init__(self, tok: Any, config: ServerConfig) -> None:
        self.tok = tok
        self.ordinary_ids = ordinary_id_count(tok)  # the ids the stand-in's top log-probabilities draw from
        self.generate_cached = lru_cache(maxsize=65536)(self._generate)
        self.chat_prompt = lru_cache(maxsize=65536)(self._chat_prompt)
        self.reset(config)

    def reset(self, config: ServerConfig) -> None:
        self.config = config
        self.ready_at = time.monotonic() + config.warmup_s
        self.rids: set[str] = set()  # registered (in-flight) request ids, as SGLang keeps them
        self.generations: dict[str, dict[str, Any]] = {}  # chat answers by id: GET /v1/generation's records
        self.lookups: Counter[str] = Counter()  # GET /v1/generation tries per id (generation_lag)
        self.recorded_at: dict[str, float] = {}  # monotonic time each record was made (record_delay_s)
        self.refused = 0
        if hasattr(self, "model"):
            self.model.rates = config.noncanonical_rates()  # keeps its vocabulary tables
        else:
            self.model = DevTextModel(self.tok, config.noncanonical_rates())
        self.stats = Stats()
        self.generate_cached.cache_clear()

    def _generate(
        self, prompt: tuple[int, ...], max_new: int, temperature: float, seed: int | None, dataset: str | None
    ) -> Generation:
        return self.model.generate(
            list(prompt), max_new_tokens=max_new, temperature=temperature, seed=seed, dataset=dataset
        )

    def _chat_prompt(self, key: str) -> tuple[int, ...]:
        """The prompt ids of a chat request in the mode it asked for, through the family's own
        template: each family names the mode its own way (Kimi's `thinking`, Qwen3's
        `enable_thinking`), which the format knows and the server must not."""
        messages, tools, thinking = json.loads(key)
        fmt = get_output_format(self.tok, thinking=bool(thinking))
        return tuple(fmt.generation_prompt_ids(messages, tools or None))

    def unavailable(self) -> bool:
        down = 0 < self.refused < self.config.refuse_first
        return down or not self.config.healthy or time.monotonic() < self.ready_at

    async def admit(
        self, endpoint: str, request: Request, key: str, wait: bool = True
    ) -> tuple[str | None, set[str], EndpointFaults, float]:
        """Count the request, draw its faults, sleep its latency (`wait`; else a stream spends it
        sending keep-alives); returns (error, rewrites, faults, latency)."""
        self.stats.requests[endpoint][key] += 1
        faults = self.config.faults(endpoint)
        error, rewrites, latency = faults.draw(self.config.rng(endpoint, key, self.stats.requests[endpoint][key]))
        arrived = sum(self.stats.requests[endpoint].values())
        if (
            faults.stall_after is not None
            and faults.stall_after < arrived <= faults.stall_after + faults.stall_requests
        ):
            self.stats.faults[endpoint]["stall"] += 1
            error, latency = None, faults.stall_s  # accepted, then never answered in time: a hung engine
        latency = faults.timeout_sleep_s if error == "timeout" else latency
        if wait:
            self.stats.in_flight[endpoint] += 1
            self.stats.max_in_flight[endpoint] = max(self.stats.max_in_flight[endpoint], self.stats.in_flight[endpoint])
            try:
                await asyncio.sleep(latency)
            finally:
                self.stats.in_flight[endpoint] -= 1
        if error in (None, "timeout", "malformed_json", "empty_content", "choice_error"):  # answers that are billed
            if faults.credits_after is not None and self.stats.total_answered[endpoint] >= faults.credits_after:
                error = "credits"
            elif faults.forbidden_after is not None and self.stats.total_answered[endpoint] >= faults.forbidden_after:
                error = "forbidden"
            else:
                self.stats.total_answered[endpoint] += 1
        if error:
            self.stats.faults[endpoint][error] += 1
        return (None if error == "timeout" else error), rewrites, faults, latency

    async def delivered(self, endpoint: str, key: str, request: Request) -> bool:
        """Count an answer as delivered (billed) unless its client is gone; such answers are
        `abandoned` (a real provider may still bill them: see docs/generation.md)."""
        if await request.is_disconnected():
            self.stats.abandoned[endpoint] += 1
            return False
        self.stats.answered[endpoint][key] += 1
        return True
