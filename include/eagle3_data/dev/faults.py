"""Configuration of the dev inference server: per-dataset text rates and per-endpoint faults.

Fault decisions are seeded by (seed, endpoint, sample key, attempt number of that sample), not by
arrival order, so a test with 256 concurrent requests injects the same faults every run and a
retried request gets a fresh, independent draw (a fault at rate 0.2 never blocks a sample forever).

YAML shape (every key optional)::

    seed: 0
    model: moonshotai/kimi-k2.5
    provider: DevProvider
    price_per_token: {prompt: 6.0e-7, completion: 2.5e-6}   # USD -> usage.cost
    include_stop_in_output_ids: true     # whether /generate output_ids end with <|im_end|> (SGLang: always)
    stop_id_override: null               # a misconfigured server: stop with this id instead (e.g. 163533)
    warmup_s: 0.0                        # /health (and /generate) answer 503 for this long after (re)config
    healthy: true                        # false: /health and /generate answer 503 (an endpoint that is down)
    refuse_first: 0                      # the first N /generate requests answer 503, /health too until all N
                                         # are refused: an endpoint that goes down and comes back
    weight_version: dev                  # /model_info and meta_info.weight_version
    datasets:                            # picked by header X-Eagle3-Dataset, else "default"
      default: {noncanonical_rate: 0.0}
      tool_calls: {noncanonical_rate: 0.02}
    endpoints:                           # "generate" (/generate) and "chat" (/v1/chat/completions)
      chat:
        latency: {dist: fixed, mean: 0.5}          # fixed | uniform (low, high) | lognormal (mean, sigma)
        rate_limit: 0.05                           # 429 with Retry-After
        retry_after_s: 0.2
        server_error: 0.05                         # 502/503
        timeout: 0.01                              # sleep timeout_sleep_s, then answer
        timeout_sleep_s: 30
        malformed_json: 0.01
        empty_content: 0.01
        bad_request: 0.0                           # 400 (permanent: never retried)
        trim_whitespace: 0.1
        rewrite_tool_call_ids: 0.1
        reserialize_arguments: 0.1
        omit_cost: 0.0                             # answer without usage.cost (a provider that does not price)
        credits_after: null                        # 402 for every request after N answered ones
        stall_after: null                          # requests N+1 .. N+stall_requests (in arrival order) hang:
        stall_requests: 0                          #   accepted, answered only after stall_s (a stuck engine;
        stall_s: 3600                              #   later requests answer normally)
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3_data.errors import UserError

ERROR_FAULTS = ("rate_limit", "server_error", "timeout", "malformed_json", "empty_content", "bad_request")
CONTENT_FAULTS = ("trim_whitespace", "rewrite_tool_call_ids", "reserialize_arguments")


@dataclass
class EndpointFaults:
    latency: dict = field(default_factory=lambda: {"dist": "fixed", "mean": 0.0})
    rate_limit: float = 0.0
    retry_after_s: float = 0.2
    server_error: float = 0.0
    timeout: float = 0.0
    timeout_sleep_s: float = 30.0
    malformed_json: float = 0.0
    empty_content: float = 0.0
    bad_request: float = 0.0
    trim_whitespace: float = 0.0
    rewrite_tool_call_ids: float = 0.0
    reserialize_arguments: float = 0.0
    omit_cost: float = 0.0
    credits_after: int | None = None
    stall_after: int | None = None
    stall_requests: int = 0
    stall_s: float = 3600.0

    def draw(self, rng: random.Random) -> tuple[str | None, set[str], float]:
        """One request's fate: an error fault (or None), content rewrites, and its latency."""
        u, error = rng.random(), None
        for name in ERROR_FAULTS:
            p = getattr(self, name)
            if u < p:
                error = name
                break
            u -= p
        rewrites = {name for name in CONTENT_FAULTS if rng.random() < getattr(self, name)}
        if self.omit_cost and rng.random() < self.omit_cost:  # drawn only when set: other seeds keep their draws
            rewrites.add("omit_cost")
        return error, rewrites, self._latency(rng)

    def _latency(self, rng: random.Random) -> float:
        dist, mean = self.latency.get("dist", "fixed"), float(self.latency.get("mean", 0.0))
        if dist == "uniform":
            return rng.uniform(float(self.latency.get("low", 0.0)), float(self.latency.get("high", 2 * mean)))
        if dist == "lognormal":
            sigma = float(self.latency.get("sigma", 0.5))
            return mean * rng.lognormvariate(-sigma * sigma / 2, sigma)  # E[...] == mean
        return mean


@dataclass
class ServerConfig:
    seed: int = 0
    model: str = "moonshotai/kimi-k2.5"
    provider: str = "DevProvider"
    price_per_token: dict = field(default_factory=lambda: {"prompt": 6.0e-7, "completion": 2.5e-6})
    include_stop_in_output_ids: bool = True
    stop_id_override: int | None = None
    warmup_s: float = 0.0
    healthy: bool = True
    refuse_first: int = 0
    weight_version: str = "dev"
    max_running_requests: int | None = None  # reported by /server_info as SGLang does; None: not set
    datasets: dict = field(default_factory=lambda: {"default": {"noncanonical_rate": 0.0}})
    endpoints: dict[str, EndpointFaults] = field(default_factory=dict)

    def faults(self, endpoint: str) -> EndpointFaults:
        return self.endpoints.get(endpoint) or EndpointFaults()

    def noncanonical_rates(self) -> dict[str, float]:
        return {name: float((d or {}).get("noncanonical_rate", 0.0)) for name, d in self.datasets.items()}

    def rng(self, endpoint: str, key: str, attempt: int) -> random.Random:
        digest = hashlib.sha256(json.dumps([self.seed, endpoint, key, attempt]).encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))


def load_config(path: str | Path | None) -> ServerConfig:
    """Read the YAML above; unknown keys are errors so a typo cannot silently disable a fault."""
    if path is None:
        return ServerConfig()
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"dev server config {path}: {exc}") from exc
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "config") -> ServerConfig:
    known = set(ServerConfig.__dataclass_fields__)
    if unknown := set(raw) - known:
        raise UserError(f"{source}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    endpoints = {}
    for name, spec in (raw.get("endpoints") or {}).items():
        if name not in ("generate", "chat"):
            raise UserError(f"{source}: endpoints.{name}: expected 'generate' or 'chat'")
        bad = set(spec or {}) - set(EndpointFaults.__dataclass_fields__)
        if bad:
            raise UserError(f"{source}: endpoints.{name}: unknown keys {sorted(bad)}")
        endpoints[name] = EndpointFaults(**(spec or {}))
    values = {k: v for k, v in raw.items() if k != "endpoints"}
    return ServerConfig(**values, endpoints=endpoints)
