"""The gate's default thresholds, in one place: the config's validation defaults and validate.py's
library defaults both use these. A module of its own so that `eagle3-data validate` does not
import the config models (pydantic schema building, ~0.4 s CPU at start-up) to read a few numbers."""

DEFAULT_MAX_BPE_MISMATCH_RATE = 0.10
DEFAULT_MAX_BILLING_DEVIATION = 0.01
DEFAULT_MAX_BAD_ROW_RATE = 0.0
DEFAULT_MAX_MISSING_USAGE_RATE = 0.0
DEFAULT_MAX_IDENTITY_MISMATCH_RATE = 0.0
# The prompt side of billing (stages.validate.billing.compare_billed_prompts), in tokens per answer: the
# provider renders the same template with the same tokenizer, so an honest count is exact; a few
# tokens more on every answer is a system prompt or a tool declaration we do not train on.
DEFAULT_MAX_PROMPT_BILLING_MEAN_ABS_DIFF = 1.0
DEFAULT_MAX_PROMPT_BILLING_ROW_DIFF = 2
DEFAULT_MAX_PROMPT_BILLING_ROW_RATE = 0.0
# The policy check (policy_check.py): the shift in mean log-probability per token under the
# target that matters (a provider ignoring top_p 0.95 measured +0.18..+0.57 on the tiny model; a
# lower-bit quantisation may move it less: lower it and score more to see one), the rate at which
# an honest provider may fail a dataset, and the power the report states the detectable shift at.
DEFAULT_POLICY_SHIFT_NATS = 0.1
DEFAULT_POLICY_FALSE_ALARM_RATE = 0.001
DEFAULT_POLICY_POWER = 0.9
# Prompt rows the loader refuses (bad JSON, unknown roles, over the limits), as a share of rows
# read: a converter that breaks most of a dataset must stop the run at load, not look green.
DEFAULT_MAX_REJECTED_PROMPT_RATE = 0.01
