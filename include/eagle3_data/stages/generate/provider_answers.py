"""What an OpenRouter response means, as the service documents it and answers in practice.

One place decides, for every shape a response takes, what the overflow client does with it
(docs/generation.md, "OpenRouter responses" has the table):

- an HTTP error (`{"error": {"code", "message", "metadata"}}`): retried with backoff (408, 429,
  5xx, 524, 529), a stop of the whole dispatch (401; 402 out of credits; 403 key limit, workspace
  budget, permission), a pause and retry (402 with `Retry-After` or the in-flight budget's
  `metadata.limit_source`), or a permanent failure of that one prompt (400, 404, 413, 422; a 403
  guardrail or moderation block of its text);
- a 200 that carries an error: at top level, no choices and no usage (a provider failed after
  OpenRouter started the request), or inside the choice with `finish_reason: "error"` next to
  partial output (a stream's mid-stream `error` event); retried unless usage says it was billed,
  then the paid partial answer is final (see `paid`). Without a cost in the answer the bill is
  unknown (OpenRouter warns that prompt processing may be charged when no content came back):
  one named by a generation id is priced from OpenRouter's record before the retry, as a cut
  stream is (`cost_unknown`, openrouter_attempts.AttemptLedger.lose);
- an answer: its text read as the provider returns it (`reasoning`, else the text kinds of
  `reasoning_details`; encrypted or summarised reasoning cannot give the model's ids), its tool
  calls with their arguments as a JSON string (an object is serialised and the row says so).

Sources: OpenRouter's docs (api_reference/errors-and-debugging.mdx, limits.mdx, the OpenAPI
ChatResult/ReasoningDetail types) and the response bodies other clients recorded (402 in-flight
budget: `metadata.reason: in_flight_budget_exhausted`, `limit_source: openrouter_in_flight_budget`,
`Retry-After`; 403 `Key limit exceeded (total limit)`; 200 `{"error": ...}` without choices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from eagle3_data.retry import PERMANENT_STATUS, parse_retry_after
from eagle3_data.stages.generate.contracts import StopReason

Action = Literal["retry", "pause", "permanent", "stop"]


@dataclass(frozen=True)
class Verdict:
    """What to do with one failed attempt. `reason` names the status, the provider's code and
    message (never the request); `retry_after_s`: the service's hint; `stop`: the stage's
    stopped_reason when `action` is "stop" (or when retries run out, for a pause or a 429);
    `prompt_specific`: the failure is about this prompt, not the config (openrouter_breaker)."""

    action: Action
    reason: str
    retry_after_s: float | None = None
    stop: StopReason | None = None
    prompt_specific: bool = (
        False  # a permanent failure of this prompt's text (moderation, too large): never trips the breaker
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    """`value` when it is a JSON object, else an empty one: the provider's bodies are read
    field by field, whatever shape they have."""
    return value if isinstance(value, Mapping) else {}


def error_of(body: Any) -> Mapping[str, Any]:
    """The `error` object of a body (OpenRouter's, or a bare string as some servers send)."""
    err = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(err, str):
        return {"message": err}
    return err if isinstance(err, Mapping) else {}


def describe(err: Mapping[str, Any], status: int | None = None) -> str:
    """`HTTP 403: Key limit exceeded (total limit)`, `provider error 502 (Chutes): ...`: the
    provider's own code and message, cut to 300 characters, and where it came from."""
    meta = _mapping(err.get("metadata"))
    message = str(err.get("message") or "no message")
    raw = meta.get("raw")
    if raw and str(raw) not in message:
        message += f" [{str(raw)[:200]}]"
    who = meta.get("provider_name")
    code = err.get("code") if err.get("code") is not None else err.get("http_status")
    head = f"HTTP {status}" if status is not None else f"provider error {code if code is not None else '?'}"
    return f"{head}{f' ({who})' if who else ''}: {message}"[:300]


def classify_status(status: int, body: Any, headers: Mapping[str, str]) -> Verdict:
    """An HTTP error answer of POST /chat/completions."""
    err = error_of(body)
    meta = _mapping(err.get("metadata"))
    reason = describe(err, status)
    retry_after = _retry_after(headers, meta)
    if status == 401:
        return Verdict("stop", reason, stop=StopReason.UNAUTHORIZED)
    if status == 402:
        in_flight = "in_flight" in str(meta.get("limit_source") or "") or "in_flight" in str(meta.get("reason") or "")
        if in_flight or retry_after is not None:  # reserved for requests in flight: passes when they settle
            return Verdict(
                "pause", reason, retry_after if retry_after is not None else 30.0, stop=StopReason.IN_FLIGHT_BUDGET
            )
        return Verdict("stop", reason, stop=StopReason.CREDITS)
    if status == 403:
        if _blocks_this_prompt(err, meta):
            return Verdict("permanent", reason, prompt_specific=True)
        return Verdict("stop", reason, stop=StopReason.FORBIDDEN)  # a key limit or policy: every request would get it
    if status in PERMANENT_STATUS:
        return Verdict("permanent", reason, prompt_specific=status == 413)  # 413: this prompt is too large
    return Verdict("retry", reason, retry_after, stop=StopReason.RATE_LIMITED if status == 429 else None)


def _blocks_this_prompt(err: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """A moderation flag (`reasons`, `flagged_input`) or a guardrail's pattern match
    (`patterns`, "Request blocked ..."): the prompt's text is refused, not the key."""
    return bool(meta.get("reasons") or meta.get("flagged_input") or meta.get("patterns")) or str(
        err.get("message") or ""
    ).startswith("Request blocked")


def _retry_after(headers: Mapping[str, str], meta: Mapping[str, Any]) -> float | None:
    hinted = parse_retry_after(headers.get("retry-after") if headers else None)
    if hinted is None and isinstance(meta.get("headers"), Mapping):
        hinted = parse_retry_after(meta["headers"].get("Retry-After") or meta["headers"].get("retry-after"))
    if hinted is None and meta.get("retry_after_seconds") is not None:
        hinted = parse_retry_after(str(meta["retry_after_seconds"]))
    return hinted


def paid(body: Mapping[str, Any]) -> bool:
    """Whether a 2xx body says tokens were billed: a cost, or completion tokens counted."""
    usage = _mapping(body.get("usage"))
    return bool(usage.get("cost") or usage.get("completion_tokens"))


def cost_unknown(body: Any) -> bool:
    """Whether an error body leaves its bill unknown: no `usage.cost` in it (a cost of 0 says
    nothing was billed; one above 0 makes it a paid answer, `paid`)."""
    usage = body.get("usage") if isinstance(body, Mapping) else None
    return not (isinstance(usage, Mapping) and isinstance(usage.get("cost"), (int, float)))


def body_error(body: Any) -> Verdict | None:
    """A 2xx body that is an error, not an answer: None when it is an answer (paid or not)."""
    if not isinstance(body, Mapping):
        return Verdict("retry", "malformed answer: the body is not a JSON object")
    err = error_of(body)
    if err and not body.get("choices"):
        return Verdict(
            "retry",
            describe(err),
            _retry_after({}, err.get("metadata") or {}),
            stop=StopReason.RATE_LIMITED if err.get("code") == 429 else None,
        )
    choices = body.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], Mapping) else {}
    if choice.get("finish_reason") == "error" or choice.get("error"):
        why = describe(error_of(choice) or {"message": "finish_reason error"})
        return None if paid(body) else Verdict("retry", f"{why} (mid-generation, no cost in the answer)")
    return None


@dataclass
class AnswerText:
    """An answer's message as the row stores it, and what reading it found."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    problem: str | None = None  # why the row fails (paid: final)
    unreconstructable: str | None = None  # why its text cannot give the model's ids
    rewritten: tuple[str, ...] = ()  # what was changed to store it (recorded in provenance)


def read_message(message: Mapping[str, Any]) -> AnswerText:
    """Reasoning from `message.reasoning`, else the `reasoning.text` entries of
    `reasoning_details` in `index` order; tool-call arguments as the JSON string the model wrote
    (an object, as some upstreams send, is serialised compactly and the row marks it)."""
    reasoning = message.get("reasoning")
    unreconstructable = None
    details = [d for d in message.get("reasoning_details") or [] if isinstance(d, Mapping)]
    if reasoning is None and details:
        texts = sorted(
            (d for d in details if d.get("type") == "reasoning.text" and d.get("text")),
            key=lambda d: d.get("index") or 0,
        )
        if texts:
            reasoning = "".join(d["text"] for d in texts)
        else:
            kinds = sorted({str(d.get("type")) for d in details})
            unreconstructable = (
                f"reasoning returned only as {', '.join(kinds)} (encrypted or summarised by the "
                "provider): the text the model generated is not in the answer"
            )
    calls, rewritten, problem = [], [], None
    for c in message.get("tool_calls") or []:
        fn = _mapping(c.get("function")) if isinstance(c, Mapping) else {}
        args = fn.get("arguments")
        if isinstance(args, (dict, list)):
            args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
            rewritten.append("tool_call_arguments_serialised")
        if not fn.get("name") or not isinstance(args, str):
            problem = "malformed tool call: missing name or arguments"
        calls.append(
            {
                "id": c.get("id") if isinstance(c, Mapping) else None,
                "type": "function",
                "function": {"name": fn.get("name"), "arguments": args},
            }
        )
    if reasoning is not None and not isinstance(reasoning, str):
        problem, reasoning = f"message.reasoning is a {type(reasoning).__name__}, not text", None
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        problem, content = f"message.content is a {type(content).__name__}, not text", None
    return AnswerText(reasoning, content, calls, problem, unreconstructable, tuple(dict.fromkeys(rewritten)))
