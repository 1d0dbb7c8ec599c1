"""Mismatch classes: how the rebuild of a generation through the overflow path differs from the
engine's ids, one row at a time.

The gate (stages/validate) decides on these classes and the policy check (stages/policy) picks
its samples through the same validator, so the classification sits below both.

Classes (CLASSES, the one definition; reports render whatever is in it):
- `exact`: the rebuild is the engine's ids.
- `bpe_only`: same bytes and special-token structure, a different (non-canonical) BPE split.
- `structure`: the server's parsers reshape this generation (an implicit reasoning end, a
  leading reasoning opener, whitespace the tool regexes drop, a call they discard, arguments that are not
  valid JSON, a tool section with no tools offered, ...): the overflow path cannot reproduce it,
  whatever the ids look like. `detail` says which.
- `special_token`: equal text, different special structure: literal special-token text that a
  parser reads as structure (a literal end-of-reasoning tag inside reasoning), or a different stop id.
- `text_diff`: the decoded text differs (e.g. a cut inside a multi-byte character).
- `wrong_stop`: the row stopped on an id that is not an audited stop id (the engine's `matched`,
  or a trailing id where the dataset's stop rows include theirs), or a `length` row ends with one.
- `stop_string`: the engine stopped on a stop string: the ids run through the token completing
  it, which no overflow answer reproduces.
- `prefix`: a length cut right after the end-of-reasoning token: the provider's answer cannot show that last
  token, so the overflow rebuild is the engine's ids minus it (a strict prefix, never a wrong id);
  counted, does not fail the gate.
- `unreconstructable`: had this generation gone the overflow way, its answer could not determine
  the ids (`reconstruct.unreconstructable_reason`: a length cut with tools offered, inside a
  multi-byte character, ...), so the overflow path excludes it instead of rebuilding it: it
  carries no error into training data and does not fail the gate; `detail` says why.
Literal special-token text the server passes through (a literal stop token in content) is
rebuilt as text and counts as exact; samples containing any are counted either way.

How stop ids appear is decided per dataset (`detect_stop_convention`) before the rows are
classed. The core streams rows in bounded chunks, so memory does not grow with the input.

Modules, in the order a row goes through them: `rows` (readers), `stops` (the dataset's stop
convention), `classify` (one row's class), `pool` (chunks on worker processes).
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

__all__ = [
    "CHUNK_ROWS",
    "CLASSES",
    "COLUMNS",
    "FAILING_CLASSES",
    "OPTIONAL_COLUMNS",
    "BadRow",
    "InputRow",
    "RowResult",
    "StopConvention",
    "Validator",
    "can_fork_workers",
    "detect_stop_convention",
    "rows_from_batches",
    "rows_from_file",
    "rows_from_jsonl",
    "validate_batches",
    "validate_rows",
]
