"""Stage 5, the gate: round trip on local ids + billed-vs-reconstructed counts on overflow rows.

The per-row work is `eagle3_data.stages.validate`; this module composes the dataset's run gate from the
two reports' data (`run_gate`), commits it in the validate manifest, and reads it back for merge
and publish (`gate_results`).
"""

from __future__ import annotations

import os
from typing import Any

from eagle3_data.config import ValidationConfig
from eagle3_data.errors import GateFailed
from eagle3_data.policy_check import Thresholds, policy_gate
from eagle3_data.rejects import REJECTS_FILE
from eagle3_data.runs.results import Gate, ValidateResult
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, bulk_tokenizer_for, log, output_format, stage_ref, tokenizer_hashes
from eagle3_data.runs.upstream import gate_from_manifest, policy_summary, row_routes
from eagle3_data.stages import BILLING_REPORT, LOCAL, POLICY, RECONSTRUCT, VALIDATE, VALIDATION_REPORT
from eagle3_data.storage.writer import StageWriter

_CHUNK = 4096


def run_gate(
    local_report: dict[str, Any],
    billing: dict[str, Any],
    thresholds: ValidationConfig,
    identity: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
) -> Gate:
    """The dataset's gate: the local round trip's, the overflow billing checks' (completion
    tokens; prompt tokens, `billing["prompt"]`), the identity count's and the policy check's own
    decisions (`eagle3_data.stages.validate`, `eagle3_data.stages.policy`), combined; no reason is reinterpreted here.
    `unvalidated_overflow`: no local sample validated the format while overflow rows exist (fails
    unless `validation.allow_unvalidated_overflow`; the report flags it either way)."""
    reasons = [f"local round trip: {r}" for r in local_report["gate"]["reasons"]]
    reasons += [f"overflow billing: {r}" for r in billing["gate"]["reasons"]]
    reasons += [
        f"overflow prompt billing: {r}" for r in (billing.get("prompt") or {}).get("gate", {}).get("reasons", [])
    ]
    reasons += [f"identity: {r}" for r in (identity or {}).get("gate", {}).get("reasons", [])]
    reasons += [f"policy: {r}" for r in (policy or {}).get("reasons", [])]
    notes = [f"local round trip: {w}" for w in local_report["gate"].get("warnings", [])]
    notes += [f"overflow billing: {n}" for n in billing["gate"].get("notes", [])]
    notes += list((policy or {}).get("notes", []))
    return Gate(
        passed=not reasons,
        reasons=reasons,
        thresholds=thresholds.model_dump(),
        notes=notes,
        unvalidated_overflow=local_report["samples"] == 0 and billing["rows"] > 0,
    )


def _ok_batches(store, ref, columns):
    import pyarrow.compute as pc

    for batch in store.iter_batches(ref, columns=[*columns, "status"]):
        yield batch.filter(pc.equal(batch.column("status"), "ok")).select(columns)


def _prompt_billing_rows(store, ref):
    """(sample_id, usage.prompt_tokens, len(prompt_ids)) of each answer the provider billed and
    the overflow path keeps (ok or unreconstructable: its prompt ids are ours either way); the
    lengths from Arrow, so no prompt's ids become Python objects."""
    import pyarrow.compute as pc

    for b in store.iter_batches(ref, columns=["sample_id", "usage", "prompt_ids", "status"]):
        lengths = pc.list_value_length(b.column("prompt_ids")).to_pylist()
        for sid, usage, status, n in zip(
            b.column("sample_id").to_pylist(), b.column("usage").to_pylist(), b.column("status").to_pylist(), lengths
        ):
            if status in ("ok", "unreconstructable"):
                yield sid, (usage or {}).get("prompt_tokens"), n or 0


def _rows_with_ids(store, ref, ids: set[str]):
    """Rows of these sample_ids only, filtered in Arrow: a large stage is never turned into dicts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not ids:
        return
    keys = pa.array(sorted(ids), pa.string())
    for batch in store.iter_batches(ref):
        yield from batch.filter(pc.is_in(batch.column("sample_id"), value_set=keys)).to_pylist()


def validate(run: Run, store, dataset: str, *, workers: int | None = None) -> ValidateResult:
    """Write the dataset's validation and billing reports and commit its gate; raise GateFailed
    (message: why, and the report's URI) when the gate fails. The reports are written either way.

    `workers`: forked validation processes, default one per CPU core as `eagle3-data validate`
    does. Safe inside an Airflow task: the pool forks its workers with SIGTERM's default action
    and reaps them after a full run and after an early stop, whatever handler the task holds."""
    from eagle3_data.stages.validate import COLUMNS as VALIDATE_COLUMNS
    from eagle3_data.stages.validate import (
        ValidationSummary,
        compare_billed_counts,
        compare_billed_prompts,
        detect_stop_convention,
        identity_report,
        rows_from_batches,
        validate_rows,
        validation_rows_table,
    )
    from eagle3_data.stages.validate.consistency import consistency_report

    local, rebuilt, ref = (
        stage_ref(run, LOCAL, dataset),
        stage_ref(run, RECONSTRUCT, dataset),
        stage_ref(run, VALIDATE, dataset),
    )
    policy_ref = stage_ref(run, POLICY, dataset)
    inputs = [local, rebuilt] + ([policy_ref] if store.is_complete(policy_ref) else [])
    thresholds = run.config.dataset(dataset).validation
    # encode/decode only: the verified tiktoken fast start, no chat template
    tokenizer, fmt = bulk_tokenizer_for(run, store), output_format(run, store, template=False)
    hashes = tokenizer_hashes(tokenizer)
    # the load's threshold is checked by load + route: it changes nothing validated here
    params = {
        "thresholds": thresholds.model_dump(exclude={"max_rejected_prompt_rate"}),
        "thinking": run.config.generation.sampling.thinking,
        **hashes,
    }
    if (manifest := settle(run, store, ref, inputs, params, what=f"validate {dataset}")) is None:

        def local_rows():  # two passes: the stop convention over all rows first, then the classes
            # provenance: the engine's finish_reason (its `matched` stop); tools: what was offered
            return rows_from_batches(_ok_batches(store, local, list(VALIDATE_COLUMNS)), len(tokenizer))

        stops = detect_stop_convention(fmt, local_rows())
        summary = ValidationSummary(
            thresholds.max_bpe_mismatch_rate, stops, thresholds.max_bad_row_rate, thresholds.allow_unvalidated_overflow
        )
        with StageWriter(
            store, ref, "validation_rows", rows_per_part=_CHUNK, params=params, inputs=inputs, fresh=True, **hashes
        ) as w:
            chunk = []
            workers = workers or os.cpu_count() or 1
            for item in validate_rows(fmt, local_rows(), stops=stops, on_bad_row="skip", workers=workers):
                summary.add(item)
                chunk.append(item)
                if len(chunk) >= _CHUNK:
                    w.write(validation_rows_table(chunk, dataset, run.config.generation.local.engine))
                    chunk = []
            if chunk:
                w.write(validation_rows_table(chunk, dataset, run.config.generation.local.engine))
            _write_rejects(store, ref, dataset, local, summary)
            local_report = summary.report()
            billing = compare_billed_counts(
                (
                    (
                        r["sample_id"],
                        (r["usage"] or {}).get("completion_tokens"),
                        len(r["output_ids"] or []),
                        r["error"] if r["status"] == "unreconstructable" else None,
                    )
                    for b in store.iter_batches(
                        rebuilt, columns=["sample_id", "usage", "output_ids", "status", "error"]
                    )
                    for r in b.to_pylist()
                    if r["status"] in ("ok", "unreconstructable")
                ),
                max_aggregate_deviation=thresholds.max_billing_deviation,
                max_missing_usage_rate=thresholds.max_missing_usage_rate,
            )
            billing["prompt"] = compare_billed_prompts(
                _prompt_billing_rows(store, rebuilt),
                max_mean_abs_diff=thresholds.max_prompt_billing_mean_abs_diff,
                max_row_diff=thresholds.max_prompt_billing_row_diff,
                max_row_rate=thresholds.max_prompt_billing_row_rate,
                max_missing_usage_rate=thresholds.max_missing_usage_rate,
            )
            identity = identity_report(
                (
                    r
                    for ref_ in (local, rebuilt)
                    for b in store.iter_batches(ref_, columns=["sample_id", "source", "status", "error", "provenance"])
                    for r in b.to_pylist()
                ),
                max_rate=thresholds.max_identity_mismatch_rate,
            )
            figures = policy_summary(run, store, dataset)
            policy = policy_gate(figures, Thresholds.from_config(thresholds))
            gate = run_gate(local_report, billing, thresholds, identity, policy).as_dict()
            gate.pop("report_uri")
            # Calibration: samples routed "both", engine ids vs the provider's reconstructed text.
            # Informational, not a gate: docs/generation.md says what it can and cannot prove.
            both = {sid for sid, route in row_routes(run, store, dataset).items() if route == "both"}
            calibration = consistency_report(
                fmt, _rows_with_ids(store, local, both), _rows_with_ids(store, rebuilt, both), sample_ids=both
            )
            store.put_json(
                ref,
                VALIDATION_REPORT,
                {
                    **local_report,
                    "dataset": dataset,
                    "run_gate": gate,
                    "calibration": calibration,
                    "identity": identity,
                    "policy": {**policy, "figures": figures},
                },
            )
            store.put_json(ref, BILLING_REPORT, {**billing, "dataset": dataset})
            prompt = billing["prompt"]
            manifest = w.commit(
                extra={
                    "gate": gate,
                    "counts": local_report["counts"],
                    "prompt_billing": {
                        "rows": prompt["rows"],
                        "mean_abs_diff": prompt["mean_abs_diff"],
                        "over_tolerance": prompt["over_tolerance"]["rows"],
                        "missing_usage": prompt["missing_usage"]["rows"],
                    },
                    "identity": {k: identity[k] for k in ("answered", "mismatched", "rate")},
                },
                files=[VALIDATION_REPORT, BILLING_REPORT, REJECTS_FILE],
            )
    uri = store.uri(ref, VALIDATION_REPORT)
    gate = gate_from_manifest(manifest, uri)
    if not gate.passed:
        raise GateFailed(f"dataset {dataset}: validation gate failed: {'; '.join(gate.reasons)}; report: {uri}")
    return ValidateResult(uri=store.uri(ref), report_uri=uri, counts=manifest["extra"]["counts"], gate=gate)


def _write_rejects(store, ref, dataset: str, local, summary) -> None:
    """The local rows validation could not read (`BadRow`: row, field, reason) as `rejects.parquet`
    beside the parts, logged per reason; rows in but none readable: fail, commit nothing."""
    from eagle3_data.rejects import format_rejects, reject, rejects_parquet, require_accepted

    source = store.uri(local)
    rejects = [
        reject(
            dataset,
            source,
            int(b["row"].rsplit(" ", 1)[-1]) if b["row"].rsplit(" ", 1)[-1].isdigit() else 0,
            b["field"],
            b["error"],
            {"sample_id": b["sample_id"]},
        )
        for b in summary.bad_rows
    ]
    accepted = sum(summary.counts.values())
    store.put_bytes(ref, REJECTS_FILE, rejects_parquet(rejects))
    (log.warning if rejects else log.info)(
        "%s", format_rejects(rejects, accepted + len(rejects), f"validate {dataset}")
    )
    require_accepted(accepted, accepted + len(rejects), rejects, f"validate {dataset}", store.uri(ref, REJECTS_FILE))
