"""Bulk mismatch validation, the gate before training ids are trusted.

Local generations carry the engine's exact ids. The gate compares them with the rebuild of
exactly what an OpenAI-compatible server returns for that generation (the provider's view:
`OutputFormat.provider_view`, the kimi_k2 reasoning and tool-call parsers' split, checked against
SGLang's own parsers), put through the overflow reconstruction code path. So the error it
measures is the error the overflow share carries, including what the parsers throw away.

The classes and the per-row work are `eagle3_data.mismatch` (the policy check classes rows too).

Modules: `gate` (the report and decision), `billing` (the overflow share's billed-token checks,
completion and prompt), `identity` (answers from another model or provider than the pinned one),
`consistency` (the calibration prompts: engine ids vs the provider's text), `stage` (the
stage as the DAG and CLI run it), `cli`.
"""

from eagle3_data.mismatch.classify import CLASSES, FAILING_CLASSES, RowResult, Validator
from eagle3_data.mismatch.pool import CHUNK_ROWS, can_fork_workers, validate_batches, validate_rows
from eagle3_data.mismatch.rows import (
    COLUMNS,
    OPTIONAL_COLUMNS,
    BadRow,
    InputRow,
    rows_from_batches,
    rows_from_file,
    rows_from_jsonl,
)
from eagle3_data.mismatch.stops import StopConvention, detect_stop_convention
from eagle3_data.stages.validate.billing import compare_billed_counts, compare_billed_prompts
from eagle3_data.stages.validate.gate import (
    EXAMPLES,
    ValidationSummary,
    bad_row_reasons,
    validate_to_report,
    validation_rows_table,
)
from eagle3_data.stages.validate.identity import identity_report

__all__ = [
    "CHUNK_ROWS",
    "CLASSES",
    "COLUMNS",
    "EXAMPLES",
    "FAILING_CLASSES",
    "OPTIONAL_COLUMNS",
    "BadRow",
    "InputRow",
    "RowResult",
    "StopConvention",
    "ValidationSummary",
    "Validator",
    "bad_row_reasons",
    "can_fork_workers",
    "compare_billed_counts",
    "compare_billed_prompts",
    "detect_stop_convention",
    "identity_report",
    "rows_from_batches",
    "rows_from_file",
    "rows_from_jsonl",
    "validate_batches",
    "validate_rows",
    "validate_to_report",
    "validation_rows_table",
]
