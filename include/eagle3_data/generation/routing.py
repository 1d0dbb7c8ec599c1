"""Which samples go local (SGLang) and which overflow (OpenRouter), and whether the two agree.

Routes are a pure function of the sample_ids and the routing numbers: samples are ranked by a hash
of their sample_id, so a sample keeps its route whatever the file order and the counts are exact.
A calibration overlap of K samples goes both ways (route "both") at temperature 0; comparing the
engine's ids with the reconstruction of the provider's text over the first N tokens tells whether
the provider plausibly serves the same model and template. docs/generation.md says what that
comparison can and cannot prove.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence

from eagle3_data.chat_format import OutputFormat
from eagle3_data.errors import UserError


def local_capacity(tokens_per_s: float, time_budget_s: float, expected_tokens_per_sample: float) -> int:
    """Samples the local endpoints finish in the time budget (aggregate throughput x time / tokens)."""
    if tokens_per_s < 0 or time_budget_s < 0 or expected_tokens_per_sample <= 0:
        raise UserError("routing capacity: tokens_per_s and time_budget_s must be >= 0, expected tokens > 0")
    return math.floor(tokens_per_s * time_budget_s / expected_tokens_per_sample)


def assign_routes(
    sample_ids: Sequence[str],
    *,
    strategy: str = "fraction",
    overflow_fraction: float = 0.0,
    local_capacity: int = 0,
    calibration_samples: int = 0,
    local_endpoints: int = 1,
    local_latency_s: float = 60.0,
    overflow_latency_s: float = 6.0,
    in_flight_per_endpoint: int = 64,
    overflow_concurrency: int = 256,
) -> list[str]:
    """The route of each sample ("local" | "overflow" | "both"), in the order of `sample_ids`.

    Only the ids are needed (not the rows): the prompts stage spills its rows and routes from
    the ids alone, so routing costs no memory per prompt beyond its id.

    fraction: round(n * overflow_fraction) samples overflow; capacity: `local_capacity` stay local;
    balanced: the local count that makes both sides, running at once, finish together
    (generation.balance, from the endpoints, in-flight, concurrency and observed latencies).
    The first `calibration_samples` local-ranked samples get route "both" (they count as local).
    """
    from eagle3_data.generation.balance import STRATEGIES, balanced_local_count, side_rates

    if strategy not in STRATEGIES:
        raise UserError(f"routing strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not 0.0 <= overflow_fraction <= 1.0:
        raise UserError(f"routing overflow_fraction {overflow_fraction}: expected a value in [0, 1]")
    ranked = sorted(sample_ids, key=lambda sid: hashlib.sha256(sid.encode()).digest())
    n = len(ranked)
    n_local = n - round(n * overflow_fraction) if strategy == "fraction" else min(n, max(0, local_capacity))
    if strategy == "balanced":
        rates = side_rates(
            local_endpoints=local_endpoints,
            in_flight_per_endpoint=in_flight_per_endpoint,
            local_latency_s=local_latency_s,
            overflow_concurrency=overflow_concurrency,
            overflow_latency_s=overflow_latency_s,
        )
        n_local = balanced_local_count(n, calibration_samples, rates)
    n_both = min(max(0, calibration_samples), n_local)
    route = {sid: ("both" if i < n_both else "local") if i < n_local else "overflow" for i, sid in enumerate(ranked)}
    return [route[sid] for sid in sample_ids]


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
    local_rows: Iterable[dict],
    overflow_rows: Iterable[dict],
    first_n: int = 64,
    sample_ids: Iterable[str] | None = None,
) -> dict:
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
    format bound to the run's generation mode: a rebuild in the other mode differs by a `</think>`.
    """
    from eagle3_data.reconstruct import reconstruct_rows, row_to_reconstruct

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


def _plain(row: dict) -> dict:
    out = dict(row)
    if isinstance(out.get("tool_calls"), str):
        out["tool_calls"] = json.loads(out["tool_calls"])
    return out
