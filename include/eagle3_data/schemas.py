"""Versioned Arrow schemas of every artifact the stages exchange.

One place for the record shapes, so a reader can tell an artifact it understands from one
written by a newer or foreign version (schema name + version travel in the manifest and in the
Parquet schema metadata). Nested free-form structures (messages, tools, tool calls, provenance)
are canonical JSON strings: Parquet's nested types cannot hold OpenAI messages faithfully.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

USAGE = pa.struct(
    [
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
    ]
)

PROMPTS_V1 = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("sample_index", pa.int64()),  # index of the row in its source file (and repeat number)
        ("messages", pa.string()),  # canonical JSON list of OpenAI chat messages
        ("tools", pa.string()),  # canonical JSON list of OpenAI tools, null when none
        ("route", pa.string()),  # "local" | "overflow" | "both" (calibration overlap)
    ]
)
# v2: the prompt row's own `id`, kept as provenance beside the sample id (null when it had none)
PROMPTS_V2 = PROMPTS_V1.append(pa.field("source_id", pa.string()))
# v3: the prompt's images, canonical JSON list of references in prompt order (images.py), null for text
PROMPTS = PROMPTS_V2.append(pa.field("images", pa.string()))

IDENTITY_MISMATCH = "identity_mismatch"  # a generation row's status: answered by a model/provider not pinned

GENERATIONS_V1 = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),  # engine ids (sglang) or reconstructed (openrouter)
        ("source", pa.string()),  # "sglang" | "openrouter"
        # "ok" | "failed" | "unreconstructable" (overflow text cannot determine the ids) | IDENTITY_MISMATCH
        ("status", pa.string()),
        ("error", pa.string()),  # reason when not ok
        ("reasoning", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.string()),  # canonical JSON list, null when none
        ("finish_reason", pa.string()),  # "stop" | "length" | "tool_calls" | ...
        ("usage", USAGE),
        ("provenance", pa.string()),  # JSON: model, provider, generation_id, sampling, tokenizer_sha256
    ]
)
# v2: the local engine's log-probability of each output id, as it reports them (provenance
# `logprobs.distribution`: vLLM's raw model distribution; SGLang's after temperature scaling, before
# top-k/top-p, unless its server sets SGLANG_RETURN_ORIGINAL_LOGPROB); null for text-only answers
GENERATIONS_V2 = GENERATIONS_V1.append(pa.field("output_logprobs", pa.list_(pa.float32())))
# v3: the prompt's images (the prompts row's `images`), so merge and extraction can feed them
GENERATIONS = GENERATIONS_V2.append(pa.field("images", pa.string()))

VALIDATION_ROWS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source", pa.string()),
        ("class", pa.string()),  # one of eagle3_data.stages.validate.CLASSES
        ("first_diff", pa.int64()),
        ("original", pa.list_(pa.string())),
        ("reconstructed", pa.list_(pa.string())),
        ("output_tokens", pa.int64()),
        ("billed_tokens", pa.int64()),
    ]
)

MERGED = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("truncated", pa.bool_()),
        ("finish_reason", pa.string()),
        ("provenance", pa.string()),
    ]
)

# The policy check's scored samples: each answer token's log-probability under the target.
POLICY_SCORES = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("side", pa.string()),  # "local" | "overflow"
        ("route", pa.string()),  # "local" | "overflow" | "both" (calibration)
        ("scored_tokens", pa.int32()),
        ("logprobs", pa.list_(pa.float32())),  # of the answer ids, in order (nats)
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "generations": GENERATIONS,
    "validation_rows": VALIDATION_ROWS,
    "merged": MERGED,
    "policy_scores": POLICY_SCORES,
}

# Prompt rows the loader refused, kept as an artifact so nobody has to re-derive why a row is missing.
REJECTS = pa.schema(
    [
        ("dataset", pa.string()),
        ("source", pa.string()),  # file (s3://... or path) the row came from
        ("line", pa.int64()),  # 1-based line (JSONL) or row number (Parquet)
        ("field", pa.string()),  # e.g. "messages[2].tool_calls[0].function.arguments"
        ("reason", pa.string()),
        ("raw", pa.string()),  # the row as read, truncated
    ]
)
SCHEMAS["rejects"] = REJECTS

# Per-schema version: bump one when its shape changes; readers refuse newer ones and read the
# older ones kept here (a column a version added reads as absent from an older part).
SCHEMA_VERSIONS: dict[str, int] = {**{name: SCHEMA_VERSION for name in SCHEMAS}, "prompts": 3, "generations": 3}
OLDER_SCHEMAS: dict[tuple[str, int], pa.Schema] = {
    ("prompts", 1): PROMPTS_V1,
    ("prompts", 2): PROMPTS_V2,
    ("generations", 1): GENERATIONS_V1,
    ("generations", 2): GENERATIONS_V2,
}


def schema_for(name: str, version: int | None = None) -> pa.Schema:
    """The schema `name` at `version` (default: current), or a UserError a person can act on."""
    from eagle3_data.errors import UserError

    if name not in SCHEMAS:
        raise UserError(
            f"unknown artifact schema {name!r} (this code knows {sorted(SCHEMAS)}): written by another tool?"
        )
    current = SCHEMA_VERSIONS[name]
    if version is not None and (name, version) in OLDER_SCHEMAS:
        return OLDER_SCHEMAS[name, version].with_metadata(
            {b"eagle3.schema": name.encode(), b"eagle3.schema_version": str(version).encode()}
        )
    if version is not None and version != current:
        newer = "newer" if version > current else "older"
        raise UserError(
            f"artifact schema {name!r} version {version} is {newer} than this code's version {current}: "
            f"{'upgrade eagle3-data' if version > current else 'rerun the stage that wrote it'}"
        )
    return SCHEMAS[name].with_metadata(
        {b"eagle3.schema": name.encode(), b"eagle3.schema_version": str(current).encode()}
    )
