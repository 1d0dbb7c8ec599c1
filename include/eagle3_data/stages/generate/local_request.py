"""One request of the local stage: a prompt's ids to an endpoint, the answer's row back.

Prompts go as ids rendered by the tokenizer's chat template, never as text, so the prompt ids
recorded are the ones the model saw; an engine that ran other prompt ids than were sent (a server
that truncates prompts) fails the row. Request ids are fresh per request
(`{sample_id}.{run}.{attempt}`, `run` random per stage run): SGLang refuses a rid still
registered, and notices a dropped client only every few seconds (a hung engine never lets it go),
so a task retried after a kill must not reuse its killed rids. `stop_token_ids` is always sent,
from the audited ids; the matched stop token stays in the ids the engine returns, recorded as
given (the validator decides what a row's stop means).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.engines.client import MediaDiffers, PromptCut, Wire, error_message, read_media
from eagle3_data.images import ImageError
from eagle3_data.json_records import fast_loads
from eagle3_data.retry import PERMANENT_STATUS
from eagle3_data.schemas import IDENTITY_MISMATCH
from eagle3_data.stages.generate.checkpoint import Prompt, generation_row, sampling_for
from eagle3_data.stages.generate.contracts import GenerationRow

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore


class Outcome(NamedTuple):
    """One request's result for the worker loop."""

    row: GenerationRow
    permanent: bool = False  # a failed row no attempt can fix
    endpoint_failed: bool = False  # counts toward dropping the endpoint
    backpressure: bool = False  # the engine is full: the same attempt again later


class Rendered(NamedTuple):
    """A prompt's ids and, for an image prompt, its media as the wire sends them."""

    prompt_ids: list[int]
    media: Any


class LocalRequester:
    """What every request of the stage carries besides its prompt, and the one request (`send`)."""

    def __init__(
        self,
        store: ArtifactStore,
        fmt: OutputFormat,
        wire: Wire,
        sampling: dict[str, Any],
        *,
        model: str,
        served_model: str | None,
        tokenizer_sha256: str | None,
    ) -> None:
        self.store, self.fmt, self.wire, self.sampling = store, fmt, wire, sampling
        self.model, self.served_model, self.tokenizer_sha256 = model, served_model, tokenizer_sha256
        self.run_tag = uuid.uuid4().hex[:8]

    async def send(
        self, http: aiohttp.ClientSession, endpoint: str, identity: dict[str, Any], prompt: Prompt, attempt: int
    ) -> Outcome:
        """One request: an ok row, or a failed row and whether it is final (no attempt can fix it);
        transport errors and 5xx count against the endpoint, a full queue against nothing."""
        rendered = await self._render(prompt)
        if isinstance(rendered, Outcome):
            return rendered
        source, prompt_ids = self.wire.source, rendered.prompt_ids
        sampling = sampling_for(prompt, self.sampling)
        rid = f"{prompt.sample_id}.{self.run_tag}.{attempt}"  # fresh per request: SGLang refuses a rid still registered
        path, body = self.wire.request(prompt_ids, sampling, rid, identity, rendered.media)
        headers = {"X-Request-Id": rid, "X-Eagle3-Dataset": prompt.dataset, "X-Eagle3-Sample-Id": prompt.sample_id}
        started = time.monotonic()
        try:
            async with http.post(f"{endpoint}{path}", json=body, headers=headers) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            reason = f"transport: {type(exc).__name__} from {endpoint}"
            return Outcome(generation_row(prompt, prompt_ids, source, failed=reason), endpoint_failed=True)
        if status != 200:
            if self.wire.backpressure(status, text):
                return Outcome(generation_row(prompt, prompt_ids, source), backpressure=True)
            reason = f"HTTP {status} from {endpoint}: {error_message(text)[:300]}"
            return Outcome(
                generation_row(prompt, prompt_ids, source, failed=reason),
                permanent=status in PERMANENT_STATUS,
                endpoint_failed=status >= 500 or status in (401, 403),
            )
        request = _Request(endpoint, identity, rendered, sampling, rid, started)
        return self._answered(prompt, text, request)

    async def _render(self, prompt: Prompt) -> Rendered | Outcome:
        """The prompt's ids and media; a permanent failure when the template refuses the
        conversation or an image is gone."""
        source = self.wire.source
        try:
            prompt_ids = self.fmt.generation_prompt_ids(prompt.messages, prompt.tools, prompt.images)
        except Exception as exc:  # the template refuses this conversation: permanent
            return Outcome(generation_row(prompt, None, source, failed=f"chat template: {exc}"), permanent=True)
        media = None
        if prompt.images:
            try:
                # S3 reads and decoding: off the event loop
                media = await asyncio.to_thread(read_media, self.store, prompt.images, self.fmt.media_pad_id)
            except ImageError as exc:  # the stored object is gone or not the one the prompt recorded
                return Outcome(generation_row(prompt, prompt_ids, source, failed=f"images: {exc}"), permanent=True)
        return Rendered(prompt_ids, media)

    def _answered(self, prompt: Prompt, text: str, request: _Request) -> Outcome:
        """The row of a 200 answer, or why it is failed."""
        source, endpoint, prompt_ids = self.wire.source, request.endpoint, request.rendered.prompt_ids

        def failed(reason: str, permanent: bool = False) -> Outcome:
            return Outcome(generation_row(prompt, prompt_ids, source, failed=reason), permanent=permanent)

        try:
            answer = self.wire.answer(fast_loads(text), prompt_ids, request.identity, request.rendered.media)
        except PromptCut as exc:  # every attempt on this server cuts it the same way
            return failed(f"prompt cut by {endpoint}: {exc}", permanent=True)
        except MediaDiffers as exc:  # its processor counts the same way on every attempt
            return failed(f"media tokens: {endpoint} {exc}", permanent=True)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return failed(f"malformed answer from {endpoint}: {exc}")
        ids, finish, engine_provenance = answer.output_ids, answer.finish, answer.provenance
        if finish["type"] not in ("stop", "length"):
            return failed(f"finish_reason {finish!r} from {endpoint}")
        named = engine_provenance.get("served_model")
        if self.served_model is not None and named is not None and named != self.served_model:
            row = generation_row(
                prompt,
                prompt_ids,
                source,
                failed=f"identity: model: answered by {named!r}, pinned "
                f"{self.served_model!r} (generation.local.served_model) at {endpoint}",
            )
            row["status"] = IDENTITY_MISMATCH
            row["provenance"] = json.dumps({"served_model": named, "endpoint": endpoint})
            return Outcome(row, permanent=True)
        msg = self.fmt.parse_ids(ids, finish["type"]).message
        end = self.fmt.reasoning_end_id
        reasoning_tokens = (ids.index(end) if end in ids else len(ids)) if self.fmt.thinking and end is not None else 0
        row = generation_row(prompt, prompt_ids, source)
        row.update(
            {
                "output_ids": ids,
                "output_logprobs": answer.logprobs,
                "reasoning": msg.reasoning,
                "content": msg.content,
                "tool_calls": json.dumps([c.to_openai() for c in msg.tool_calls], ensure_ascii=False)
                if msg.tool_calls
                else None,
                "finish_reason": finish["type"],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(ids),
                    "reasoning_tokens": reasoning_tokens,
                    "cost_usd": None,
                },
                "provenance": json.dumps(
                    {
                        "model": self.model,
                        "engine": source,
                        "endpoint": endpoint,
                        "sampling": request.sampling,
                        "thinking": self.fmt.thinking,
                        "tokenizer_sha256": self.tokenizer_sha256,
                        "rid": request.rid,
                        "e2e_latency": round(time.monotonic() - request.started, 4),
                        "finish_reason": finish,
                        "generated_at": time.time(),
                        "logprobs": self.wire.logprob_distribution(request.sampling),
                        **engine_provenance,
                        **_source(prompt),
                    },
                    sort_keys=True,
                ),
            }
        )
        return Outcome(row)


class _Request(NamedTuple):
    """What a 200 answer is read against: where it went and what was sent."""

    endpoint: str
    identity: dict[str, Any]
    rendered: Rendered
    sampling: dict[str, Any]
    rid: str
    started: float  # monotonic, when it was sent


def _source(prompt: Prompt) -> dict[str, Any]:
    """The prompt row's own id, when it had one (provenance beside the sample id)."""
    return {"source_id": prompt.source_id} if prompt.source_id is not None else {}
