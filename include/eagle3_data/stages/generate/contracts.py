"""What crosses the generation modules, typed once, so a row or a summary is followed by its type:

  GenerationRow  one sample's row: built by `checkpoint.generation_row` (both clients), journaled
                 and written by `checkpoint.StageRun` (schemas.GENERATIONS, the same columns), then
                 read back as Parquet by reconstruction, validation and the merge;
  StageSummary   what a generation stage returns, fresh or reused (`checkpoint.stage_summary`);
  StopReason     why a stage stopped before completion: its `stopped_reason`;
  HealthTimings  the timings an endpoint's `/health` wait reads (local.wait_healthy).

Beside them: the output format is `chat_format.base.OutputFormat`, a progress sink
`progress.ProgressSink`, a stage's turns `conversations.TurnDriver`.

Plain dicts at run time (TypedDicts): rows go to Arrow and JSON lines as they are, summaries to
the CLI's JSON output, and every reader indexes them as before.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NotRequired, TypedDict


class Usage(TypedDict):
    """schemas.USAGE: what the answer cost, in tokens and (overflow) USD."""

    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    cost_usd: float | None


class GenerationRow(TypedDict):
    """One row of a generation stage, in schemas.GENERATIONS' column order.

    `status`: "ok" | "failed" | "unreconstructable" | schemas.IDENTITY_MISMATCH, with `error` when
    not ok. `messages`, `tools`, `tool_calls`, `provenance`: JSON strings (the prompt row's own
    spellings for the first two). `output_ids`: the engine's ids (local), null for text answers
    until reconstruction."""

    sample_id: str
    dataset: str
    messages: str
    tools: str | None
    prompt_ids: list[int] | None
    output_ids: list[int] | None
    source: str
    status: str
    error: str | None
    reasoning: str | None
    content: str | None
    tool_calls: str | None
    finish_reason: str | None
    usage: Usage | None
    provenance: str | None
    output_logprobs: list[float] | None
    images: NotRequired[str | None]  # the prompt's image references (images.py), JSON; absent for text


class StopReason(StrEnum):
    """Why a generation stage stopped before completion (its summary's `stopped_reason`). Those
    that `passes` are retried as they are (Airflow retries the task); the others need a person
    (the account, the config, the budget) before a retry can pass. Equal to their strings."""

    BUDGET = "budget"  # the next request could pass generation.overflow.max_usd
    UNPRICED = "unpriced_answer"  # an answer without a cost anywhere while a budget binds
    UNAUTHORIZED = "unauthorized"  # 401
    CREDITS = "credits"  # 402 out of credits
    FORBIDDEN = "forbidden"  # 403: a key limit, a workspace budget, a permission
    REPEATED_ERROR = "repeated_error"  # max_identical_errors identical permanent errors in a row
    RATE_LIMITED = "rate_limited"  # 429s past every retry
    IN_FLIGHT_BUDGET = "in_flight_budget"  # 402s for the in-flight budget past every retry
    RETRYABLE_FAILURES = "retryable_failures"  # samples failed this attempt, none finally
    ENDPOINTS_LOST = "endpoints_lost"  # every local endpoint failed and none came back within a warm-up
    ERROR = "error"  # the client broke: its error propagates (never a summary's)

    @property
    def passes(self) -> bool:
        return self in _PASSING


_PASSING = frozenset(
    {StopReason.RATE_LIMITED, StopReason.IN_FLIGHT_BUDGET, StopReason.RETRYABLE_FAILURES, StopReason.ENDPOINTS_LOST}
)


class StageSummary(TypedDict):
    """What a generation stage returns. `complete`: its manifest is committed (`reused`: it was
    before this call, nothing was asked). `counts`: ok, failed, paid_failed, skipped, replayed,
    retry_later, lost_attempts, total (a reused stage: its manifest's). `stop_detail`: the
    provider's or the endpoints' words for the stop. `cost_usd`: spent by this attempt;
    `spent_before_usd`: by the attempts before it."""

    uri: str
    complete: bool
    reused: bool
    stopped_reason: StopReason | None
    stop_detail: str | None
    counts: dict[str, int]
    tokens: int
    cost_usd: float
    spent_before_usd: float
