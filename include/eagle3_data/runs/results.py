"""What each stage returns: small typed records of URIs and counts (never data).

The DAG puts `as_dict()` into XCom; tests and the CLI read the fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class _Result:
    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AuditResult(_Result):
    report_uri: str
    tokenizer_sha256: str


@dataclass(frozen=True)
class RouteResult(_Result):
    """load_route: the routed prompts stage, or (dry run) the plan written instead."""

    counts: dict[str, int]
    uri: str | None = None
    plan_uri: str | None = None
    plan: dict[str, Any] | None = None


@dataclass(frozen=True)
class GenerationResult(_Result):
    uri: str
    counts: dict[str, int] = field(default_factory=dict)
    rows: int | None = None
    tokens: int | None = None
    cost_usd: float | None = None
    reused: bool = False


@dataclass(frozen=True)
class ReconstructResult(_Result):
    uri: str
    rows: int
    reused: bool


@dataclass(frozen=True)
class PolicyResult(_Result):
    uri: str
    scored: dict[str, int]  # samples scored per side
    gap_nats_per_token: float | None
    reused: bool = False


@dataclass(frozen=True)
class Gate(_Result):
    """One dataset's gate decision, as committed in its validate manifest."""

    passed: bool
    reasons: list[str]
    report_uri: str | None = None
    thresholds: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unvalidated_overflow: bool = False
    # the dataset's task that failed in this DAG run while an earlier run's gate is committed
    # (pipeline.validate.gate_results): that gate is not this run's
    failed_task: str | None = None


@dataclass(frozen=True)
class ValidateResult(_Result):
    uri: str
    report_uri: str
    counts: dict[str, int]
    gate: Gate


@dataclass(frozen=True)
class MergeResult(_Result):
    uri: str
    datasets: list[str]
    shards: list[dict[str, Any]]
    totals: dict[str, Any]


@dataclass(frozen=True)
class ShardResult(_Result):
    shard: str
    samples: int
    tokens: int
    bytes: int
    skipped: bool = False  # committed by an earlier attempt: not extracted again


@dataclass(frozen=True)
class ExtractWorkerResult(_Result):
    """extract_hidden_states: one GPU worker's shards; `backend_loads` is 1 when any shard
    needed extracting (the model is loaded once per worker), 0 when all were already committed."""

    worker: int
    backend_loads: int
    shards: list[ShardResult]


@dataclass(frozen=True)
class PublishResult(_Result):
    """publish: the run summary; `changed` is False when the summary already said the same
    (an idempotent rerun), so the DAG emits no second Asset event for the same result."""

    run_key: str
    report_uri: str | None
    summary_uri: str | None
    datasets: list[str]
    merged_uri: str | None = None
    hidden_states_uri: str | None = None
    cost_usd: float = 0.0
    changed: bool = True
    totals: dict[str, Any] | None = None  # dry run: the plan's totals
    summary: dict[str, Any] = field(default_factory=dict, repr=False)
    stand_ins: list[str] = field(default_factory=list)  # what the run ran on instead of the real thing


@dataclass(frozen=True)
class ProbeResult(_Result):
    """probe: the drafter's verdict on the run's export (eagle3_data.stages.probe.drafter); `uri` is its JSON."""

    uri: str
    simulated_acceptance: float
    acc: list[float]
    coverage: float
    reused: bool = False
    verdict: str | None = None  # pass / fail / inconclusive (probe.verdict); None: a probe from before verdicts
    verdict_rule: str | None = None


@dataclass(frozen=True)
class ProbeSkipped(_Result):
    """probe: not run, and why (off, nothing extracted, `auto` on a worker without a GPU, or a
    pace that projects past the budget under `auto`): the DAG's skip message and the log's line."""

    reason: str
