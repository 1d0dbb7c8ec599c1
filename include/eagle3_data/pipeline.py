"""The stages as the DAG (and the CLI, and tests) call them: thin glue between library modules,
one module per stage, in the order the DAG runs them:

  run (resolve_run, open_store) -> audit -> route (load_route) -> generate (local | overflow,
  concurrently) -> reconstruct -> policy (score_policy) -> validate (the gate) -> merge -> extract
  (hidden states) -> probe
  (the drafter's verdict, optional) -> publish

Each stage takes a resolved `Run` (config + params + run key), an `ArtifactStore` and, for
per-dataset stages, a dataset name; it reads its inputs from S3, writes its outputs with a
manifest, and returns a small typed result of URIs and counts (`results`; the DAG puts
`as_dict()` into XCom). Reuse follows one rule (`reuse.reusable`): a stage whose manifest is
complete with the same params and input manifests is not recomputed, so a rerun of one dataset
(or a backfill of a date already done) leaves every other artifact byte-identical.
"""

from eagle3_data.extraction_params import hidden_states_params
from eagle3_data.runs.results import (
    AuditResult,
    Gate,
    GenerationResult,
    MergeResult,
    PolicyResult,
    ProbeResult,
    ProbeSkipped,
    PublishResult,
    ReconstructResult,
    RouteResult,
    ShardResult,
    ValidateResult,
)
from eagle3_data.runs.reuse import reusable
from eagle3_data.runs.run import (
    Run,
    bulk_tokenizer_for,
    check_prompt_sources,
    open_store,
    output_format,
    preflight,
    resolve_run,
    stage_ref,
    tokenizer_for,
)
from eagle3_data.runs.timeouts import generation_timeout
from eagle3_data.runs.upstream import gate_results, run_datasets
from eagle3_data.stages import RUN_DATASET
from eagle3_data.stages.audit.stage import audit_tokenizer
from eagle3_data.stages.generate.stage import generate_local, generate_overflow
from eagle3_data.stages.hidden_states.stage import (
    commit_hidden_states,
    discard_stale_hidden_states,
    extract_hidden_states,
    plan_hidden_states,
)
from eagle3_data.stages.merge.stage import merge
from eagle3_data.stages.policy.stage import score_policy
from eagle3_data.stages.probe.stage import probe
from eagle3_data.stages.prompts.stage import load_route
from eagle3_data.stages.publish.stage import publish
from eagle3_data.stages.reconstruct.stage import reconstruct
from eagle3_data.stages.validate.stage import run_gate, validate

__all__ = [
    "RUN_DATASET",
    "AuditResult",
    "Gate",
    "GenerationResult",
    "MergeResult",
    "PolicyResult",
    "ProbeResult",
    "ProbeSkipped",
    "PublishResult",
    "ReconstructResult",
    "RouteResult",
    "Run",
    "ShardResult",
    "ValidateResult",
    "audit_tokenizer",
    "bulk_tokenizer_for",
    "check_prompt_sources",
    "commit_hidden_states",
    "discard_stale_hidden_states",
    "extract_hidden_states",
    "gate_results",
    "generate_local",
    "generate_overflow",
    "generation_timeout",
    "hidden_states_params",
    "load_route",
    "merge",
    "open_store",
    "output_format",
    "plan_hidden_states",
    "preflight",
    "probe",
    "publish",
    "reconstruct",
    "resolve_run",
    "reusable",
    "run_datasets",
    "run_gate",
    "score_policy",
    "stage_ref",
    "tokenizer_for",
    "validate",
]
