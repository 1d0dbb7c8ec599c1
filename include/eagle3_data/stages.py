"""Stage names: the `{stage}` segment of `runs/{run_key}/{stage}/{dataset}/`, in flow order.

One place, because the names are S3 paths: the pipeline writes them, merge and the report read
them, and a rename would orphan every existing run.
"""

from __future__ import annotations

AUDIT = "audit"
PLAN = "plan"  # dry runs only
PROMPTS = "prompts"
LOCAL = "generate_local"
OVERFLOW = "generate_overflow"
RECONSTRUCT = "reconstruct"
POLICY = "score_policy"
VALIDATE = "validate"
MERGE = "merge"
HIDDEN_STATES = "hidden_states"
PROBE = "probe"  # the drafter's verdict on the extraction
PUBLISH = "publish"

RUN_DATASET = "all"  # dataset segment of run-level stages (merge, hidden states, publish)
AUDIT_DATASET = "tokenizer"  # dataset segment of the tokenizer audit

# the stages a run may replace on purpose (`--fresh STAGE`, the DAG's `fresh_stages` param), in flow order
FRESH_STAGES = (AUDIT, PROMPTS, LOCAL, OVERFLOW, RECONSTRUCT, POLICY, VALIDATE, MERGE, HIDDEN_STATES, PROBE)
