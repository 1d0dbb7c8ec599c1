"""The routing consistency check: on the calibration prompts answered on both paths, do the
engine's ids and the reconstruction of the provider's text agree over the first N tokens?

Only the validate stage reads it; it compares what routing sent both ways.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from eagle3_data.chat_format import OutputFormat

# Stored with every report, so a reader of the numbers knows what they can and cannot carry.
CAN_PROVE = (
    "at temperature 0, ids that differ in the first tokens while the texts differ too mean the provider "
    "does not serve the same model, chat template, system prompt or reasoning setting (sample and "
    "position named); ids that agree over N tokens show the provider's text reconstructs to exactly "
    "the engine's tokens there"
)


CANNOT_PROVE = (
    "that the provider serves the same weights (two quantisations agree greedily for many tokens, then "
    "drift), that its sampling at temperature > 0 matches, or that it keeps doing so after the "
    "calibration window; differing ids with agreeing text are a non-canonical BPE split, not a provider "
    "problem; greedy decoding is not bit-reproducible across batch sizes and kernels, so read an "
    "agreement below 1.0 per sample, not as a threshold"
)


def consistency_report(
    fmt: OutputFormat,
    local_rows: Iterable[dict[str, Any]],
    overflow_rows: Iterable[dict[str, Any]],
    first_n: int = 64,
    sample_ids: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Compare calibration samples generated on both paths (generation rows, same sample_ids).

    Per sample: how many of the first `first_n` engine ids the reconstruction of the provider's
    text reproduces before the first difference, and whether the texts agree (ids can differ
    where the text does not: a non-canonical BPE split). `agreement` = share of samples whose first
    min(first_n, len) ids are identical; `text_agreement` = share whose texts agree;
    `text_disagreements` = the samples that point at a different model or template.
    `sample_ids`: the samples routed "both"; only they are compared, and `missing` names those
    not generated ok on both paths (`unreconstructable`: ok, but the provider's text cannot
    determine the ids, e.g. a tool call cut at the token limit; raw or as the reconstruct stage
    marked them). Without it, every sample ok on either side is considered. `fmt` is the output
    format bound to the run's generation mode: a rebuild in the other mode differs by the end-of-reasoning token.
    """
    from eagle3_data.reconstruction import reconstruct_rows, row_to_reconstruct

    wanted = None if sample_ids is None else set(sample_ids)
    local = {
        r["sample_id"]: r
        for r in local_rows
        if r.get("status") == "ok" and (wanted is None or r["sample_id"] in wanted)
    }
    provider_ok = [
        r
        for r in overflow_rows
        if r.get("status") in ("ok", "unreconstructable") and (wanted is None or r["sample_id"] in wanted)
    ]
    pairs = [r for r in provider_ok if r["sample_id"] in local]
    recon = reconstruct_rows(fmt, (row_to_reconstruct(fmt, _plain(r), f"overflow row {r['sample_id']}") for r in pairs))
    samples, unreconstructable = [], []
    for row, ids in recon:
        if row.unreconstructable:  # the text cannot determine the ids: nothing to compare
            unreconstructable.append(row.sample_id)
            continue
        engine = list(local[row.sample_id]["output_ids"])
        n = min(first_n, len(engine), len(ids))
        first_diff = next((i for i in range(n) if engine[i] != ids[i]), None)
        # Texts of the first n ids each: a BPE split makes one side's n ids cover less text, so
        # they "agree" when one is a prefix of the other (ignoring a cut multi-byte character).
        a, b = fmt.codec.decode(engine[:n]).rstrip("\ufffd"), fmt.codec.decode(ids[:n]).rstrip("\ufffd")
        common = min(len(a), len(b))
        samples.append(
            {
                "sample_id": row.sample_id,
                "compared": n,
                "first_diff": first_diff,
                "agreeing_prefix": n if first_diff is None else first_diff,
                "engine_text": a,
                "provider_text": b,
                "same_text": a[:common] == b[:common],
            }
        )
    agree = sum(s["first_diff"] is None for s in samples)
    ok_both = {s["sample_id"] for s in samples}
    expected = wanted if wanted is not None else set(local) | {r["sample_id"] for r in provider_ok}
    return {
        "first_n": first_n,
        "samples": len(samples),
        "missing": sorted(expected - ok_both - set(unreconstructable)),
        "unreconstructable": sorted(unreconstructable),
        "agreement": agree / len(samples) if samples else None,
        "text_agreement": sum(s["same_text"] for s in samples) / len(samples) if samples else None,
        "mean_agreeing_prefix": sum(s["agreeing_prefix"] for s in samples) / len(samples) if samples else None,
        "text_disagreements": sorted(s["sample_id"] for s in samples if not s["same_text"]),
        "can_prove": CAN_PROVE,
        "cannot_prove": CANNOT_PROVE,
        "per_sample": samples,
    }


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    if isinstance(out.get("tool_calls"), str):
        out["tool_calls"] = json.loads(out["tool_calls"])
    return out
