"""Configuration of the dev inference server: per-dataset text rates and per-endpoint faults.

Fault decisions are seeded by (seed, endpoint, sample key, attempt number of that sample), not by
arrival order, so a test with 256 concurrent requests injects the same faults every run and a
retried request gets a fresh, independent draw (a fault at rate 0.2 never blocks a sample forever).

YAML shape (every key optional)::

    seed: 0
    model: moonshotai/kimi-k2.5          # the model served: a request for another is a 400, as OpenRouter's
    canonical_slug: moonshotai/kimi-k2.5-20260127   # its dated slug in GET /v1/models
    answer_canonical_slug: false         # answers name the model by its canonical slug (as OpenRouter may)
    provider: Moonshot AI                # who answers when the request pins no provider (display name)
    providers: [{name: Moonshot AI, slug: moonshotai}, ...]   # GET /v1/providers (default: PROVIDERS)
    price_per_token: {prompt: 6.0e-7, completion: 2.5e-6}   # USD -> usage.cost
    include_stop_in_output_ids: true     # whether /generate output_ids end with the stop token (SGLang: always)
    stop_id_override: null               # a misconfigured server: stop with this id instead (e.g. 163533)
    warmup_s: 0.0                        # /health (and /generate) answer 503 for this long after (re)config
    healthy: true                        # false: /health and /generate answer 503 (an endpoint that is down)
    refuse_first: 0                      # the first N /generate requests answer 503, /health too until all N
                                         # are refused: an endpoint that goes down and comes back
    weight_version: dev                  # /model_info and meta_info.weight_version
    auto_truncate_to: null               # --allow-auto-truncate with this context: longer prompts lose their
                                         # tail silently; meta_info.prompt_tokens reports the cut length
    media_token_drift: 0                 # /generate expands each image's placeholder (media_pad) to this many more
                                         # tokens than Kimi-K2.5's processor: another processor version
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
        generation_lag: 0                          # GET /v1/generation?id= answers 404 this many times first
        record_delay_s: 0.0                        # ... and until this long after the generation (a late record)
        credits_after: null                        # 402 for every request after N answered ones
        forbidden_after: null                      # 403 "Key limit exceeded" for every request after N answered
        error_in_body: 0.0                         # 200 {"error": {...}}, no choices, no usage (not billed; on a
                                                   #   stream its generation is recorded at $0)
        choice_error: 0.0                          # 200, choices[0].finish_reason "error" + partial text (billed)
        in_flight_402: 0.0                         # 402 in-flight budget, Retry-After retry_after_s
        moderation: 0.0                            # 403 moderation flag of this prompt
        reasoning_details_only: 0.0                # reasoning null, its text in reasoning_details
        encrypted_reasoning: 0.0                   # reasoning null, reasoning_details encrypted only
        object_arguments: 0.0                      # tool-call arguments as a JSON object
        wrong_model: 0.0                           # the answer names other_model
        other_model: moonshotai/kimi-k2-0905
        wrong_provider: 0.0                        # the answer names other_provider
        other_provider: Chutes
        stall_after: null                          # requests N+1 .. N+stall_requests (in arrival order) hang:
        stall_requests: 0                          #   accepted, answered only after stall_s (a stuck engine;
        stall_s: 3600                              #   later requests answer normally)
        queue_full: 0.0                            # /generate: 503 "The request queue is full." (--max-queued-requests)
        stream_cut: 0.0                            # stream: the connection drops after half the chunks (billed whole)
        stream_stall: 0.0                          # stream: silent for stall_s after half the chunks (billed whole)
        stream_error: 0.0                          # stream: an `error` data event after half the chunks, no usage
                                                   #   (billed: the prompt and the tokens sent), then [DONE]
        keepalive_s: 0.5                           # stream: a ": OPENROUTER PROCESSING" comment this often while
                                                   #   the answer is prepared (its latency)
        inject_system_prompt: null                 # chat: render every request with this system message
                                                   #   prepended (a provider that adds its own): usage.prompt_tokens
                                                   #   grows by its render, the answer is generated for that prompt
        cut_after_tool_result: null                # chat: a request whose last message is a tool result is
                                                   #   answered with at most this many tokens (finish length)
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3_data.errors import UserError

# One uniform draw picks at most one error fault, in this order (new ones go last, so that a seed's
# draws for the old ones stay as they were); an answer's rewrites are drawn independently.
ERROR_FAULTS = (
    "rate_limit",
    "server_error",
    "timeout",
    "malformed_json",
    "empty_content",
    "bad_request",
    "error_in_body",
    "choice_error",
    "in_flight_402",
    "moderation",
    "queue_full",
)
CONTENT_FAULTS = ("trim_whitespace", "rewrite_tool_call_ids", "reserialize_arguments")
# Drawn only when set: other seeds keep their draws.
OPTIONAL_REWRITES = (
    "omit_cost",
    "reasoning_details_only",
    "encrypted_reasoning",
    "object_arguments",
    "wrong_model",
    "wrong_provider",
    "stream_cut",
    "stream_stall",
    "stream_error",
)
# OpenRouter's provider table (GET /api/v1/providers: name, slug), the part the dev server serves.
PROVIDERS = (
    {"name": "Moonshot AI", "slug": "moonshotai"},
    {"name": "Fireworks", "slug": "fireworks"},
    {"name": "Together", "slug": "together"},
    {"name": "DeepInfra", "slug": "deepinfra"},
    {"name": "Chutes", "slug": "chutes"},
    {"name": "Novita", "slug": "novita"},
    {"name": "Parasail", "slug": "parasail"},
    {"name": "AtlasCloud", "slug": "atlas-cloud"},
    {"name": "BaseTen", "slug": "baseten"},
    {"name": "Groq", "slug": "groq"},
)


@dataclass
class EndpointFaults:
    latency: dict[str, Any] = field(default_factory=lambda: {"dist": "fixed", "mean": 0.0})
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
    generation_lag: int = 0
    record_delay_s: float = 0.0
    credits_after: int | None = None
    forbidden_after: int | None = None
    error_in_body: float = 0.0
    choice_error: float = 0.0
    in_flight_402: float = 0.0
    moderation: float = 0.0
    reasoning_details_only: float = 0.0
    encrypted_reasoning: float = 0.0
    object_arguments: float = 0.0
    wrong_model: float = 0.0
    other_model: str = "moonshotai/kimi-k2-0905"
    wrong_provider: float = 0.0
    other_provider: str = "Chutes"
    stall_after: int | None = None
    stall_requests: int = 0
    stall_s: float = 3600.0
    queue_full: float = 0.0
    stream_cut: float = 0.0
    stream_stall: float = 0.0
    stream_error: float = 0.0
    keepalive_s: float = 0.5
    inject_system_prompt: str | None = None
    cut_after_tool_result: int | None = None

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
        for name in OPTIONAL_REWRITES:
            if getattr(self, name) and rng.random() < getattr(self, name):
                rewrites.add(name)
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
    canonical_slug: str = "moonshotai/kimi-k2.5-20260127"
    answer_canonical_slug: bool = False
    provider: str = "Moonshot AI"
    providers: list[Any] = field(default_factory=lambda: [dict(p) for p in PROVIDERS])
    price_per_token: dict[str, Any] = field(default_factory=lambda: {"prompt": 6.0e-7, "completion": 2.5e-6})
    include_stop_in_output_ids: bool = True
    stop_id_override: int | None = None
    warmup_s: float = 0.0
    healthy: bool = True
    refuse_first: int = 0
    weight_version: str = "dev"
    auto_truncate_to: int | None = None
    media_token_drift: int = 0
    max_running_requests: int | None = None  # reported by /server_info as SGLang does; None: not set
    datasets: dict[str, Any] = field(default_factory=lambda: {"default": {"noncanonical_rate": 0.0}})
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


def config_from_dict(raw: dict[str, Any], source: str = "config") -> ServerConfig:
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
