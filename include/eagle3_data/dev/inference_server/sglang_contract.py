"""SGLang 0.5.23's schema checks of a `/generate` body (its `generate_contract_error`), the ones a
client can trip, in its words (serde's error texts)."""

from __future__ import annotations

from typing import Any

# SGLang 0.5.23's accepted sampling params, in its own order (sglang/api/v1/api_types.py):
# anything else inside `sampling_params` is a 400 with serde's `unknown field` text.
SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)


def generate_contract_error(body: Any) -> str | None:
    """The schema checks of SGLang's `generate_contract_error` that a client can trip: the body
    shape, `input_ids` as ints or lists of ints, and `sampling_params` keys and int fields."""
    if not isinstance(body, dict):
        return (
            "invalid type: sequence, expected struct GenerateRequest"
            if isinstance(body, list)
            else "invalid type, expected struct GenerateRequest"
        )
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list):
            return f"invalid type: {_unexpected(ids)}, expected a value or an array of values for TokenIdsOrList"
        number = bool(ids) and isinstance(ids[0], (int, float)) and not isinstance(ids[0], bool)
        rows = [ids] if not ids or number else ids  # [] and [scalar, ...] are one list; else a batch
        for row in rows:
            if not isinstance(row, list):
                return f"invalid type: {_unexpected(row)}, expected a sequence"
            for t in row:
                if not (isinstance(t, int) and not isinstance(t, bool)):
                    return f"invalid type: {_unexpected(t)}, expected i64"
    top = body.get("top_logprobs_num")  # Int64OrList (sglang/api/v1/api_types.py:1009 decode_Int64OrList)
    if top is not None:
        for v in top if isinstance(top, list) else [top]:
            if not (isinstance(v, int) and not isinstance(v, bool)):
                what = "i64" if isinstance(top, list) else "a value or an array of values for Int64OrList"
                return f"invalid type: {_unexpected(v)}, expected {what}"
    sp = body.get("sampling_params")
    if sp is not None:
        if not isinstance(sp, dict):
            return f"invalid type: {_unexpected(sp)}, expected struct SamplingParams"
        for key, value in sp.items():
            if key not in SAMPLING_FIELDS:
                listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
                return f"unknown field `{key}`, expected one of {listed}"
            if (
                key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")
                and value is not None
                and not (isinstance(value, int) and not isinstance(value, bool))
            ):
                return f"invalid type: {_unexpected(value)}, expected i64"
    return None


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display, as SGLang's contract errors print it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__
