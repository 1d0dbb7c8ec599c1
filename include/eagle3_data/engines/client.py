"""What every caller of a local engine shares: the wire protocol (`Wire`, which sglang.py and
vllm.py implement), health and readiness, the served model's name, media, answers and scores,
and the engines' error texts.

Generation, the policy check's scoring and the route's capacity read all speak to the same
servers, so this sits below the stages: no stage reaches into another for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import aiohttp

from eagle3_data.errors import UserError
from eagle3_data.images import data_uri, read_image
from eagle3_data.retry import WAIT_NOTE_EVERY_S

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

log = logging.getLogger(__name__)


DEFAULT_IN_FLIGHT = 64  # per endpoint, when neither the config nor the endpoint says


MAX_IN_FLIGHT = 4096  # a reported capacity is clamped to the config's own bound


API_KEY_ENV = "EAGLE3_SGLANG_API_KEY"  # the CLI's source of the key (the DAG's: connection sglang_default)


def bearer_headers(api_key: str | None) -> Mapping[str, str]:
    """What every request to an engine started with `--api-key` carries: SGLang answers 401 to
    every route but `/health`, `/ready` and `/metrics` without `Authorization: Bearer <key>`
    (its `srt/utils/auth.py`); vLLM's `--api-key` takes the same header. None or "": no header
    (a server started without a key). Sent on `/health` too: harmless, and one set of headers
    for the session."""
    return MappingProxyType({"Authorization": f"Bearer {api_key}"} if api_key else {})


class Answer(NamedTuple):
    """What a wire adapter reads from an engine's answer."""

    output_ids: list[int]  # as given: through the matched stop token
    finish: dict[str, Any]  # {"type": "stop" | "length" | ..., "matched": ...}
    provenance: dict[str, Any]  # engine-specific, into the row's provenance
    logprobs: list[float] | None = None  # the engine's log-probability of each output id (None: not reported)


class Scored(NamedTuple):
    """What a wire adapter reads from a scoring answer, for the scored positions `ids[first:]`."""

    logprobs: list[float]  # log p(ids[i] | ids[:i]) under the target's unscaled distribution
    top: list[list[float]] | None = None  # per position, its `top` largest log-probabilities (None: not asked)


def top_row(values: list[float], top: int, where: str) -> list[float]:
    """One position's `top` largest log-probabilities, checked: as many as asked, and
    log-probabilities (their probabilities sum to at most 1: a vLLM server started with
    `--logprobs-mode raw_logits` answers logits there; ValueError naming `where`)."""
    if len(values) != top:
        raise ValueError(f"{where}: {len(values)} top log-probabilities, {top} asked")
    values = [float(v) for v in values]
    if sum(math.exp(min(v, 0.0)) for v in values) > 1.0 + 1e-3 or max(values, default=0.0) > 1e-3:
        raise ValueError(f"{where}: the top values are not log-probabilities (they sum above 1: logits?)")
    return values


class PromptCut(ValueError):
    """The engine ran other prompt ids than were sent (a server that truncates long prompts)."""


class MediaDiffers(ValueError):
    """The engine expanded a prompt's images to other prompt ids than ours: its processor counts
    another number of media tokens for an image (processor drift, silent otherwise)."""


class Media(NamedTuple):
    """A prompt's images as an engine takes them beside its ids. The ids sent hold one
    image placeholder (`media_pad`) per image (`images.collapse_runs`): both engines expand each one themselves,
    by their own processor's count, and report what they ran for `Wire.answer` to compare."""

    pad_id: int  # the format's `media_pad_id`
    urls: list[str]  # each image as a data URI (its stored bytes, sha256-verified), in prompt order
    tokens: list[int]  # our media-token count of each image (the reference's `media_tokens`)


def read_media(store: ArtifactStore, refs: list[dict[str, Any]], pad_id: int) -> Media:
    """A prompt's images for an engine, for generation and for the policy check's scoring alike:
    each stored object read and verified against its reference (sha256, size: ImageError
    otherwise), sent as a data URI; read per request, not held (the prompts in flight are all that
    is decoded). Run it in a thread: boto3's clients are thread-safe."""
    return Media(pad_id, [data_uri(read_image(store, ref)) for ref in refs], [int(ref["media_tokens"]) for ref in refs])


class Wire(Protocol):
    """One engine's HTTP protocol; `LocalRun` does everything else."""

    source: str  # the rows' `source`: "sglang" | "vllm"
    engine: str  # for people: "SGLang" | "vLLM"
    capacity_paths: tuple[str, ...]  # where the engine reports max_running_requests; () = nowhere
    # sent with every request (the callers' sessions' default headers): `bearer_headers` of the
    # endpoints' API key (`engines.wire_for`), empty for a server started without one
    headers: Mapping[str, str]

    def sampling(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """The config's engine-neutral sampling as this engine's request fields (UserError on a key it lacks)."""

    async def identify(self, http: aiohttp.ClientSession, endpoint: str) -> dict[str, Any]:
        """What the endpoint says it serves (weight version, served model), for provenance."""

    def request(
        self,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        rid: str,
        identity: dict[str, Any],
        media: Media | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one generation request; `prompt_ids` are ours, media tokens
        expanded; `media`: the prompt's images (None for a text prompt)."""

    def answer(self, body: Any, prompt_ids: list[int], identity: dict[str, Any], media: Media | None = None) -> Answer:
        """The answer read and checked against our `prompt_ids` (ValueError/KeyError/TypeError:
        malformed; PromptCut; MediaDiffers)."""

    def backpressure(self, status: int, text: str) -> bool:
        """The engine is full, not failing: retry later without counting against the endpoint."""

    def logprob_distribution(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """Which distribution the engine's output log-probabilities are of (provenance `logprobs`):
        what the extraction's own must be compared with (hidden_states.verify)."""

    def score_request(
        self, ids: list[int], first: int, rid: str, identity: dict[str, Any], top: int = 0, media: Media | None = None
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a request for the log-probability of each of `ids[first:]` and,
        with `top` > 0, the `top` largest log-probabilities at each of those positions, all of the
        target's unscaled distribution (no temperature, no truncation); `media`: the prompt's
        images, sent as `request` sends them (`ids` hold each image's expanded pads)."""

    def score_answer(self, body: Any, ids: list[int], first: int, top: int = 0, media: Media | None = None) -> Scored:
        """Those, read and checked against `ids` (ValueError/KeyError: malformed; MediaDiffers:
        the engine expanded the images to other ids)."""

    def score_refusal(self, status: int, text: str) -> str | None:
        """What the endpoint refuses to every scoring request (its configuration, not the item:
        more log-probabilities than it allows), in words; None for a refusal of the one item."""

    def manifest_extra(self, identities: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """What the stage's manifest records of the endpoints' identities."""


async def served_model(http: aiohttp.ClientSession, endpoint: str) -> str | None:
    """The first model `GET /v1/models` names (vLLM and SGLang: the served model name)."""
    try:
        async with http.get(f"{endpoint}/v1/models", timeout=aiohttp.ClientTimeout(total=30.0)) as r:
            if r.status == 200:
                data = (await r.json(content_type=None)).get("data") or []
                return data[0]["id"] if data else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


class HealthFailure(NamedTuple):
    """A `/health` poll that got no status: what failed, and whether the TCP connection was made
    (a server that accepts connections is alive, if slow; one that refuses them may not exist)."""

    what: str
    connected: bool


async def health(http: aiohttp.ClientSession, endpoint: str, connect_timeout_s: float) -> int | HealthFailure:
    """The status of `/health`, or what failed (and whether a connection was made at all)."""
    # SGLang's /health itself waits up to ~20 s for its one-token generation; the connection
    # attempt is bounded on its own, so a host that drops SYNs is not waited on for 30 s.
    try:
        async with http.get(
            f"{endpoint}/health", timeout=aiohttp.ClientTimeout(total=30.0, sock_connect=connect_timeout_s)
        ) as r:
            return r.status
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        return HealthFailure(exception_line(exc), connected=False)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return HealthFailure(exception_line(exc), connected=True)


async def wait_healthy(http: aiohttp.ClientSession, endpoint: str, engine: str, o: HealthTimings) -> str | None:
    """Poll `/health` until it answers 200 (None), else say what was tried. A server that answers
    (503 while it loads its model) is waited for up to `o.warmup_timeout_s`; one that accepts no
    connection at all (nothing listening, no route to it) is given up after
    `o.unreachable_timeout_s` without an answer, so a wrong URL is named in seconds. `o`: the
    timings (`local_endpoints.HealthWait`, `policy.ScoreTimings`): also `connect_timeout_s`, `health_interval_s`."""
    started = time.monotonic()
    answered_at, tries, last, note_at = started, 0, "", started
    while True:
        status = await health(http, endpoint, o.connect_timeout_s)
        tries += 1
        now = time.monotonic()
        if status == 200:
            return None
        last = f"HTTP {status}" if isinstance(status, int) else status.what
        if isinstance(status, int) or status.connected:
            answered_at = now
        tried = f"{tries} tries of GET {endpoint}/health over {now - started:.0f} s, last: {last}"
        if now - answered_at >= o.unreachable_timeout_s:
            return f"no connection for {now - answered_at:.0f} s ({tried})"
        if now - started >= o.warmup_timeout_s:
            return f"not ready after {o.warmup_timeout_s:g} s of warm-up ({tried})"
        if now >= note_at:  # the first retry already says so: a wait is never silent
            log.warning(
                "%s endpoint: waiting for %s/health ... (%d tries over %.0f s, last: %s)",
                engine,
                endpoint,
                tries,
                now - started,
                last,
            )
            note_at = now + WAIT_NOTE_EVERY_S
        await asyncio.sleep(min(o.health_interval_s, max(0.0, started + o.warmup_timeout_s - now)))


def exception_line(exc: BaseException) -> str:
    """An aiohttp/timeout failure in one short line: its type and what it says."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def server_capacity(info: Any) -> int | None:
    """`max_running_requests` of a `/server_info` answer: the top-level server arg, else the sum
    over the data-parallel ranks' `internal_states`; None when neither is a positive int."""

    def positive(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    if not isinstance(info, dict):
        return None
    if (top := positive(info.get("max_running_requests"))) is not None:
        return top
    ranks = [positive(s.get("max_running_requests")) for s in info.get("internal_states") or [] if isinstance(s, dict)]
    counted = [r for r in ranks if r is not None]
    return sum(counted) if ranks and len(counted) == len(ranks) else None


def error_message(text: str) -> str:
    """An engine's error body: `{"error": "<str>"}`, `{"error": {"message": ...}}` (SGLang),
    `{"message": ...}` (vLLM, SGLang's OpenAI-style errors); anything else verbatim."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if not isinstance(body, dict):
        return text
    err = body.get("error")
    if isinstance(err, str):
        return err
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return str(body["message"]) if isinstance(body.get("message"), str) else text


def local_endpoints(value: str | Sequence[str]) -> list[str]:
    """Endpoints from a connection field: a list, or one string of comma/space separated URLs."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    for e in items:
        if not e.startswith(("http://", "https://")):
            raise UserError(f"local endpoint {e!r}: expected an http(s) URL")
    return items


class HealthTimings(Protocol):
    """The timings of an endpoint's `/health` wait (`local_endpoints.HealthWait`, `policy.ScoreTimings`)."""

    @property
    def connect_timeout_s(self) -> float: ...

    @property
    def health_interval_s(self) -> float: ...

    @property
    def unreachable_timeout_s(self) -> float: ...

    @property
    def warmup_timeout_s(self) -> float: ...
