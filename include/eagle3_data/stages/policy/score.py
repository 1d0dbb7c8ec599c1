"""Scoring on the local engine: each item's answer ids, their log-probabilities under the target,
and, for the nucleus test, which answer tokens lie provably outside the sampling's nucleus.

Endpoints are waited for as local generation waits for them (`local.wait_healthy`). One prefill
per item through the engine's own wire (`Wire.score_request`: SGLang's `return_logprob` from
`logprob_start_len`, vLLM's `prompt_logprobs`), a few in flight per endpoint, retried with backoff on
transport errors, 5xx and a full queue. An item the engine
refuses (4xx: longer than its context, say) is left out and counted, never guessed; a refusal of
every request (`Wire.score_refusal`: more top log-probabilities than the server allows) stops the
stage with what to change. With a `nucleus`, each sampled item's request also asks for the
`top_logprobs` likeliest ids at every position, and `nucleus.outside` counts its answer
tokens outside the nucleus as the answer arrives (the [positions, K] values are not kept); each
calibration item's (greedy on both paths) with K = 1, its tokens counted off the target's argmax
(`off_argmax`), whatever the run's sampling.
An item of an image prompt (`Item.images`, when the caller gives `media`) is scored with its
images, sent as local generation sends them; an engine that expands them to other ids than ours
refuses that item (`MediaDiffers`), counted like any refusal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from eagle3_data.config import PolicyConfig
from eagle3_data.engines.client import Media, MediaDiffers, Wire, error_message, wait_healthy
from eagle3_data.errors import EndpointUnavailable, UserError
from eagle3_data.images import ImageError
from eagle3_data.nucleus import Item, Nucleus, off_argmax, outside
from eagle3_data.retry import backoff_s

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreTimings:
    """How long scoring waits for an endpoint and an answer, and how often it retries: not the
    config's (the `policy` section says what is scored), so a test may tighten them."""

    max_attempts: int = 5
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    warmup_timeout_s: float = 600.0  # an endpoint that answers but is not ready yet (loading)
    unreachable_timeout_s: float = 15.0  # one that accepts no connection at all
    health_interval_s: float = 2.0


@dataclass(frozen=True)
class ScoreEndpoints:
    """Where answers are scored: the local engines' URLs, their wire (the engine's protocol and
    headers) and how long to wait for them."""

    urls: Sequence[str]
    wire: Wire
    timings: ScoreTimings = ScoreTimings()


def score_items(
    items: Sequence[Item],
    engines: ScoreEndpoints,
    policy: PolicyConfig = PolicyConfig(),
    nucleus: Nucleus | None = None,
    vocab_size: int = 0,
    media: Callable[[Item], Media] | None = None,
) -> tuple[list[list[float] | None], dict[str, str], list[int | None]]:
    """(log-probabilities per item, None where the engine refused it; the refusals by sample id;
    per item its answer tokens outside `nucleus`, or for a calibration answer (greedy) off the
    target's argmax (`off_argmax`); None where refused, or a sampled answer without a nucleus).
    `policy`: the config's section (requests in flight per endpoint, `top_logprobs`, the margins).
    `vocab_size`: the target's, for the bound at temperatures above 1. `media`: an image item's
    images for the engine (read per request, in a thread: S3 reads); without it, an item with
    images is refused."""
    if not items:
        return [], {}, []
    return asyncio.run(_Scorer(engines, policy, nucleus, vocab_size, media).run(items))


class _Scorer:
    def __init__(
        self,
        engines: ScoreEndpoints,
        policy: PolicyConfig,
        nucleus: Nucleus | None,
        vocab: int,
        media: Callable[[Item], Media] | None,
    ):
        self.endpoints, self.wire = [e.rstrip("/") for e in engines.urls], engines.wire
        self.policy, self.timings = policy, engines.timings
        self.nucleus, self.vocab, self.media = nucleus, vocab, media
        self.refused: dict[str, str] = {}
        self.tag = uuid.uuid4().hex[:8]

    async def run(self, items: Sequence[Item]) -> tuple[list[list[float] | None], dict[str, str], list[int | None]]:
        timeout = aiohttp.ClientTimeout(
            total=self.timings.request_timeout_s, sock_connect=self.timings.connect_timeout_s
        )
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.wire.headers) as http:
            self.http = http
            problems = await asyncio.gather(
                *(wait_healthy(http, e, self.wire.engine, self.timings) for e in self.endpoints)
            )
            ready = [e for e, problem in zip(self.endpoints, problems) if problem is None]
            if not ready:
                raise EndpointUnavailable(
                    f"policy check: no {self.wire.engine} endpoint is usable: "
                    + "; ".join(f"{e}: {problem}" for e, problem in zip(self.endpoints, problems))
                    + ": nothing was scored"
                )
            self.identity = {e: await self.wire.identify(http, e) for e in ready}
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(items)):
                queue.put_nowait(i)
            out: list[tuple[list[float], int | None] | None] = [None] * len(items)
            workers = [
                self._worker(e, items, queue, out) for e in ready for _ in range(self.policy.in_flight_per_endpoint)
            ]
            await asyncio.gather(*workers)
        return [o[0] if o else None for o in out], self.refused, [o[1] if o else None for o in out]

    async def _worker(
        self,
        endpoint: str,
        items: Sequence[Item],
        queue: asyncio.Queue[int],
        out: list[tuple[list[float], int | None] | None],
    ) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            out[i] = await self._one(endpoint, items[i])

    async def _one(self, endpoint: str, item: Item) -> tuple[list[float], int | None] | None:
        ids = list(item.ids)
        greedy = item.route == "both"  # a calibration answer
        # the argmax test needs the largest log-probability only: exact at K = 1, and cheap
        top = 1 if greedy else self.policy.top_logprobs if self.nucleus is not None else 0
        media = None
        if item.images:
            if self.media is None:
                self.refused[item.sample_id] = "an image prompt, and no images given to score it with"
                return None
            try:
                media = await asyncio.to_thread(self.media, item)
            except ImageError as exc:  # the stored object is gone or not the one the row recorded
                self.refused[item.sample_id] = f"images: {exc}"
                return None
        last = "no attempt"
        for attempt in range(1, self.timings.max_attempts + 1):
            path, body = self.wire.score_request(
                ids, item.first, f"{item.sample_id}.policy.{self.tag}.{attempt}", self.identity[endpoint], top, media
            )
            try:
                async with self.http.post(f"{endpoint}{path}", json=body) as r:
                    status, text = r.status, await r.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"transport: {type(exc).__name__}"
            else:
                if status == 200:
                    try:
                        scored = self.wire.score_answer(json.loads(text), ids, item.first, top, media)
                    except MediaDiffers as exc:  # the engine's processor, not the answer: no retry fixes it
                        self.refused[item.sample_id] = f"images: {exc}"
                        return None
                    except (ValueError, KeyError, TypeError, IndexError) as exc:
                        last = f"malformed answer: {exc}"
                    else:
                        margin = self.policy.nucleus_logit_margin
                        # top >= 1 in both tests, and score_answer then gives the top log-probabilities
                        if greedy:
                            assert scored.top is not None
                            far = off_argmax(scored.logprobs, scored.top, margin, self.policy.greedy_max_gap)
                        elif self.nucleus is None:
                            return scored.logprobs, None
                        else:
                            assert scored.top is not None
                            far = outside(scored.logprobs, scored.top, self.nucleus, self.vocab, margin)
                        return scored.logprobs, int(far.sum())
                elif 400 <= status < 500 and status not in (408, 429):
                    if (why := self.wire.score_refusal(status, text)) is not None:
                        raise UserError(f"policy check: {endpoint} refuses every scoring request: {why}")
                    self.refused[item.sample_id] = f"HTTP {status}: {error_message(text)[:200]}"
                    return None
                else:
                    last = f"HTTP {status}: {error_message(text)[:200]}"
            await asyncio.sleep(backoff_s(attempt))
        raise EndpointUnavailable(
            f"policy check: {endpoint} did not score sample {item.sample_id} in "
            f"{self.timings.max_attempts} attempts (last: {last})"
        )
