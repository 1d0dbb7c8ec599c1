"""The stages, one package each, in flow order:

  audit -> prompts (load, route) -> generate (local | overflow) -> reconstruct -> policy
  (score_policy) -> validate (the gate) -> merge -> hidden_states (extract, exports) -> probe
  -> publish

A package holds the stage's own logic, `stage.py` (the stage as the DAG and the CLI run it: a
resolved `Run`, an `ArtifactStore`, a dataset; inputs read from S3, outputs written with a
manifest, a typed result returned) and `cli.py` (its `eagle3-data` command). No stage imports
another: what several stages share sits below them in `eagle3_data` (conversations, engines,
mismatch, reconstruction, nucleus, policy_check, exports, target_head, runs, plan, ...), and
what a stage reads of another's committed output is `runs.upstream`. `eagle3_data.pipeline` is
the DAG's one import of every stage.

This module holds the names: the `{stage}` segment of `runs/{run_key}/{stage}/{dataset}/` and
the names of the reports stages write. One place, because the names are S3 paths: the pipeline
writes them, merge and the report read them, and a rename would orphan every existing run.
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

# the reports and files stages write under their stage folder (read by later stages and the report)
PLAN_REPORT = "plan.json"
VALIDATION_REPORT = "report.json"
BILLING_REPORT = "billing.json"
PROBE_REPORT = "probe.json"
SUMMARY_SUFFIX = ".summary.json"
# every sampled answer's mean target log-probability per trained token, by source: the every-row policy check's input
SAMPLE_MEANS = "target_logprob_means.json"
IMAGE_COUNTS = ("image_rows", "images", "media_tokens", "image_rejects")  # a load's image figures (the report's)
POLICY_REPORT = "policy.json"
SCORES_FILE = "scores.parquet"  # schemas.POLICY_SCORES
AUDIT_REPORT = "report.json"
