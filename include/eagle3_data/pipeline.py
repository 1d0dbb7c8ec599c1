"""The stages as the DAG (and the CLI, and tests) call them: thin glue between library modules.

Each stage takes a resolved `Run` (config + params + run key), an `ArtifactStore` and, for
per-dataset stages, a dataset name; it reads its inputs from S3, writes its outputs with a
manifest, and returns a small dict of URIs and counts (what goes into XCom).

Idempotency: a stage whose manifest is complete with the same params and the same input
manifests is reused, not recomputed, so a rerun of one dataset (or a backfill of a date already
done) leaves every other artifact byte-identical. A stage that must recompute invalidates its
old manifest first, and its downstream stages notice through their inputs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from eagle3_data.config import PipelineConfig, load_config
from eagle3_data.errors import GateFailed, UserError

log = logging.getLogger(__name__)

# stage names: runs/{run_key}/{stage}/{dataset}/
AUDIT, PROMPTS, LOCAL, OVERFLOW, RECONSTRUCT, VALIDATE = (
    "audit", "prompts", "generate_local", "generate_overflow", "reconstruct", "validate"
)
MERGE, HIDDEN_STATES, PLAN = "merge", "hidden_states", "plan"
RUN_DATASET = "all"  # dataset segment of run-level stages (merge, hidden states)
VALIDATION_REPORT = "report.json"
BILLING_REPORT = "billing.json"
PLAN_REPORT = "plan.json"


@dataclass(frozen=True)
class Run:
    """One DAG run's decisions: everything a stage needs besides the store."""

    config: PipelineConfig
    run_key: str
    date: str | None  # YYYY-MM-DD prompt partition; None for manual runs without a logical date
    datasets: list[str]
    dry_run: bool
    skip_hidden_states: bool


def resolve_run(params: dict[str, Any], logical_date: datetime | None, config: PipelineConfig | None = None) -> Run:
    """Apply trigger-form params to the config (validated like the file) and pick the run key.

    Threshold params left empty keep the config's per-dataset values; a value set in the form
    applies to every dataset of the run.
    """
    from eagle3_data.report_view import run_key_for

    config = config or load_config()
    overrides: dict[str, Any] = {
        "routing": {"strategy": params.get("overflow_strategy"), "overflow_fraction": params.get("overflow_fraction")},
        "generation": {"overflow": {"max_usd": params.get("max_usd")}},
        "merge": {"max_length": params.get("max_length")},
        "hidden_states": {"convention": params.get("layer_convention")},
    }
    thresholds = {k: params.get(k) for k in ("max_bpe_mismatch_rate", "max_billing_deviation") if params.get(k) is not None}
    if thresholds:
        overrides["validation"] = thresholds
        overrides["datasets"] = [
            {**item, "validation": {**(item.get("validation") or {}), **thresholds}} for item in config.raw["datasets"]
        ]
    config = config.with_overrides(_drop_none(overrides))
    datasets = params.get("datasets") or config.dataset_names
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise UserError(f"params.datasets: expected a list of dataset names, got {datasets!r}")
    for name in datasets:
        config.dataset(name)  # UserError naming the unknown dataset
    run_key = run_key_for({"run_name": params.get("run_name")}, logical_date)
    return Run(
        config=config,
        run_key=run_key,
        date=f"{logical_date:%Y-%m-%d}" if logical_date is not None else None,
        datasets=list(dict.fromkeys(datasets)),
        dry_run=bool(params.get("dry_run")),
        skip_hidden_states=bool(params.get("skip_hidden_states")),
    )


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = _drop_none(v)
            if v:
                out[k] = v
        elif v is not None:
            out[k] = v
    return out


def open_store(config: PipelineConfig, client) -> Any:
    from eagle3_data.storage import ArtifactStore

    store = ArtifactStore(client=client, bucket=config.storage.bucket, prefix=config.storage.prefix)
    store.ensure_bucket()
    return store


# -- reuse -------------------------------------------------------------------------------------
def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def current_manifest(store, ref, params: dict, inputs: list) -> dict | None:
    """The committed manifest of `ref` if it was made from these params and input manifests."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    if _canonical(manifest.get("params")) != _canonical(params):
        return None
    want = [store.input_record(i)["manifest_sha256"] for i in inputs]
    have = [i.get("manifest_sha256") for i in manifest.get("inputs", [])]
    return manifest if want == have else None


def _ref(run: Run, stage: str, dataset: str):
    from eagle3_data.storage import StageRef

    return StageRef(run.run_key, stage, dataset)


@lru_cache(maxsize=4)
def _tokenizer(source: str):
    from eagle3_data.tokenizer import load_tokenizer

    return load_tokenizer(source)


def _tok_hashes(tokenizer) -> dict[str, str | None]:
    from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256

    return {"tokenizer_sha256": tokenizer_files_sha256(tokenizer), "template_sha256": chat_template_sha256(tokenizer)}


# -- audit -------------------------------------------------------------------------------------
def audit_tokenizer(run: Run, store) -> dict:
    """Derive and round-trip every special id by name; a wrong expectation stops the run here,
    before any generation request is sent."""
    from eagle3_data.tokenizer import audit_tokenizer as audit

    tokenizer = _tokenizer(run.config.tokenizer.source)
    report = audit(tokenizer, run.config.tokenizer.expected_special_ids).to_json()
    ref = _ref(run, AUDIT, "tokenizer")
    params = {"source": run.config.tokenizer.source, "expected": run.config.tokenizer.expected_special_ids}
    manifest = current_manifest(store, ref, params, [])
    if report["passed"] and manifest and manifest["tokenizer_sha256"] == report["tokenizer_sha256"]:
        return {"report_uri": store.uri(ref, VALIDATION_REPORT), "tokenizer_sha256": report["tokenizer_sha256"]}
    uri = store.put_json(ref, VALIDATION_REPORT, report)
    if not report["passed"]:
        raise GateFailed(f"tokenizer audit failed ({'; '.join(report['problems'])}); report: {uri}")
    store.commit_files(
        ref,
        [VALIDATION_REPORT],
        params=params,
        tokenizer_sha256=report["tokenizer_sha256"],
        template_sha256=report["chat_template_sha256"],
    )
    return {"report_uri": uri, "tokenizer_sha256": report["tokenizer_sha256"]}


# -- reconstruct -------------------------------------------------------------------------------
def reconstruct(run: Run, store, dataset: str) -> dict:
    """Overflow rows (text only) -> output_ids with the model's own format, one batched encode."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.reconstruct import reconstruct_rows, row_to_reconstruct

    src, ref = _ref(run, OVERFLOW, dataset), _ref(run, RECONSTRUCT, dataset)
    tokenizer = _tokenizer(run.config.tokenizer.source)
    hashes = _tok_hashes(tokenizer)
    params = {"thinking": run.config.generation.sampling.thinking, **hashes}
    if (manifest := current_manifest(store, ref, params, [src])) is not None:
        return {"uri": store.uri(ref), "rows": manifest["rows"], "reused": True}
    fmt, counts = get_output_format(tokenizer), {"ok": 0, "failed": 0, "unreconstructable": 0}
    with store.writer(ref, "generations", rows_per_part=1024, params=params, inputs=[src], fresh=True, **hashes) as w:
        for batch in store.iter_batches(src):
            rows = batch.to_pylist()
            ok = [r for r in rows if r["status"] == "ok"]
            todo = [row_to_reconstruct(fmt, r, store.uri(src)) for r in ok]
            by_id = {r["sample_id"]: r for r in ok}
            out = []
            for item, ids in reconstruct_rows(tokenizer, todo):
                if item.unreconstructable:  # text cannot determine the ids: kept for the billing report, never merged
                    out.append({**by_id[item.sample_id], "status": "unreconstructable", "error": f"unreconstructable: {item.unreconstructable}"})
                    counts["unreconstructable"] += 1
                else:
                    out.append({**by_id[item.sample_id], "output_ids": ids})
                    counts["ok"] += 1
            out += [r for r in rows if r["status"] != "ok"]
            counts["failed"] += len(rows) - len(ok)
            w.write(out)
        manifest = w.commit(extra={"counts": counts})
    return {"uri": store.uri(ref), "rows": manifest["rows"], "reused": False}


# -- validate (the gate) -----------------------------------------------------------------------
def _ok_batches(store, ref, columns):
    import pyarrow.compute as pc

    for batch in store.iter_batches(ref, columns=[*columns, "status"]):
        yield batch.filter(pc.equal(batch.column("status"), "ok")).select(columns)


def _rows_with_ids(store, ref, ids: set[str]):
    """Rows of these sample_ids only, filtered in Arrow: a large stage is never turned into dicts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not ids:
        return
    keys = pa.array(sorted(ids), pa.string())
    for batch in store.iter_batches(ref):
        yield from batch.filter(pc.is_in(batch.column("sample_id"), value_set=keys)).to_pylist()


def validate(run: Run, store, dataset: str) -> dict:
    """Round trip on local ids + billed-vs-reconstructed counts on overflow rows; raise GateFailed
    (message: why, and the report's URI) when either fails. The report is written either way."""
    from eagle3_data.generation.routing import consistency_report
    from eagle3_data.validate import (
        ValidationSummary,
        compare_billed_counts,
        rows_from_batches,
        validate_rows,
        validation_rows_table,
    )

    local, rebuilt, ref = _ref(run, LOCAL, dataset), _ref(run, RECONSTRUCT, dataset), _ref(run, VALIDATE, dataset)
    thresholds = run.config.dataset(dataset).validation
    tokenizer = _tokenizer(run.config.tokenizer.source)
    hashes = _tok_hashes(tokenizer)
    params = {"thresholds": vars(thresholds), "thinking": run.config.generation.sampling.thinking, **hashes}
    if (manifest := current_manifest(store, ref, params, [local, rebuilt])) is None:
        summary = ValidationSummary(thresholds.max_bpe_mismatch_rate)
        with store.writer(ref, "validation_rows", rows_per_part=4096, params=params, inputs=[local, rebuilt], fresh=True, **hashes) as w:
            rows = rows_from_batches(_ok_batches(store, local, ["sample_id", "output_ids", "finish_reason"]), len(tokenizer))
            chunk = []
            for item in validate_rows(tokenizer, rows, on_bad_row="skip", thinking=run.config.generation.sampling.thinking):
                summary.add(item)
                chunk.append(item)
                if len(chunk) >= 4096:
                    w.write(validation_rows_table(chunk, dataset, "sglang"))
                    chunk = []
            if chunk:
                w.write(validation_rows_table(chunk, dataset, "sglang"))
            local_report = summary.report()
            billing = compare_billed_counts(
                (
                    (r["sample_id"], int((r["usage"] or {}).get("completion_tokens") or 0), len(r["output_ids"] or []),
                     r["error"] if r["status"] == "unreconstructable" else None)
                    for b in store.iter_batches(rebuilt, columns=["sample_id", "usage", "output_ids", "status", "error"])
                    for r in b.to_pylist()
                    if r["status"] in ("ok", "unreconstructable")
                ),
                max_aggregate_deviation=thresholds.max_billing_deviation,
            )
            reasons = [f"local round trip: {r}" for r in local_report["gate"]["reasons"] if not (r == "no valid samples" and billing["rows"])]
            reasons += [f"overflow billing: {r}" for r in billing["gate"]["reasons"]]
            gate = {"passed": not reasons, "reasons": reasons, "thresholds": vars(thresholds),
                    "notes": [f"overflow billing: {n}" for n in billing["gate"]["notes"]]}
            # Calibration: samples routed "both", engine ids vs the provider's reconstructed text.
            # Informational, not a gate: docs/generation.md says what it can and cannot prove.
            both = {r["sample_id"] for b in store.iter_batches(_ref(run, PROMPTS, dataset), columns=["sample_id", "route"])
                    for r in b.to_pylist() if r["route"] == "both"}
            calibration = consistency_report(tokenizer, _rows_with_ids(store, local, both), _rows_with_ids(store, rebuilt, both),
                                             sample_ids=both)
            store.put_json(ref, VALIDATION_REPORT, {**local_report, "dataset": dataset, "run_gate": gate, "calibration": calibration})
            store.put_json(ref, BILLING_REPORT, {**billing, "dataset": dataset})
            manifest = w.commit(extra={"gate": gate, "counts": local_report["counts"]}, files=[VALIDATION_REPORT, BILLING_REPORT])
    gate = manifest["extra"]["gate"]
    uri = store.uri(ref, VALIDATION_REPORT)
    if not gate["passed"]:
        raise GateFailed(f"dataset {dataset}: validation gate failed: {'; '.join(gate['reasons'])}; report: {uri}")
    return {"uri": store.uri(ref), "report_uri": uri, "counts": manifest["extra"]["counts"]}


def run_datasets(run: Run, store) -> list[str]:
    """The datasets this run merges and reports: the selected ones, plus datasets of the same run
    key that an earlier run already validated and passed (a `datasets=[X]` trigger reruns X and
    keeps the others). A dataset left out of the selection after failing its gate is dropped."""
    earlier = [
        n for n in store.datasets(run.run_key, VALIDATE)
        if n not in run.datasets and n in run.config.dataset_names
        and store.read_manifest(_ref(run, VALIDATE, n))["extra"]["gate"]["passed"]
    ]
    return [n for n in run.config.dataset_names if n in run.datasets or n in earlier]


def gate_results(run: Run, store) -> dict[str, dict]:
    """Each dataset's gate as committed in S3 (missing: its validate never completed)."""
    out = {}
    for name in run_datasets(run, store):
        ref = _ref(run, VALIDATE, name)
        if store.is_complete(ref):
            out[name] = {**store.read_manifest(ref)["extra"]["gate"], "report_uri": store.uri(ref, VALIDATION_REPORT)}
        else:
            out[name] = {"passed": False, "reasons": ["validation did not complete (see the failed task)"], "report_uri": None}
    return out


# -- merge and hidden states -------------------------------------------------------------------
def merge(run: Run, store) -> dict:
    """Merge the datasets whose gate passed; fail when none did. Returns the merged shard refs."""
    from eagle3_data.merge import merge_datasets, merged_shards

    if not store.is_complete(_ref(run, AUDIT, "tokenizer")):
        raise GateFailed(f"merge: the tokenizer audit of run {run.run_key} did not pass (see task audit_tokenizer)")
    gates = gate_results(run, store)
    passed = [name for name, g in gates.items() if g["passed"]]
    if not passed:
        raise GateFailed(
            "merge: no dataset passed its gate: "
            + "; ".join(f"{n}: {', '.join(g['reasons'])} ({g['report_uri']})" for n, g in gates.items())
        )
    inputs = [ref for name in passed for ref in (_ref(run, LOCAL, name), _ref(run, RECONSTRUCT, name))]
    m = run.config.merge
    params = {"max_length": m.max_length, "length_policy": m.length_policy, "shard_tokens": m.shard_tokens, "seed": m.seed}
    ref = _ref(run, MERGE, RUN_DATASET)
    if current_manifest(store, ref, params, inputs) is None:
        store.delete(_ref(run, HIDDEN_STATES, RUN_DATASET))  # extracted from the old merge: stale
        summary = merge_datasets(store, inputs, run.run_key, **params, out_dataset=RUN_DATASET)
        shards, totals = summary["shards"], summary["totals"]
    else:
        shards, totals = merged_shards(store, ref), store.read_manifest(ref)["extra"]["totals"]
    return {"uri": store.uri(ref), "datasets": passed, "shards": shards, "totals": totals}


def _hs_params(run: Run) -> dict:
    h = run.config.hidden_states
    return {"convention": h.convention, "last_hidden": h.last_hidden, "token_budget": h.batch_tokens, "model": run.config.model.source}


def extract_hidden_states(run: Run, store, shard: dict) -> dict:
    """One merged shard through the target model; resumable by shard."""
    from eagle3_data.hidden_states.extract import extract_shard

    params = _hs_params(run)
    out_ref = _ref(run, HIDDEN_STATES, RUN_DATASET)
    if store.is_complete(out_ref) and _canonical(store.read_manifest(out_ref)["params"]) != _canonical(params):
        store.delete(out_ref)  # other convention or model: start over
    summary = extract_shard(
        store, shard, run.config.model.source, out_ref,
        convention=params["convention"], last_hidden=params["last_hidden"], token_budget=params["token_budget"],
    )
    return {"shard": shard["name"], "samples": summary["samples"], "tokens": summary["tokens"], "bytes": summary["bytes"]}


def commit_hidden_states(run: Run, store) -> dict:
    from eagle3_data.hidden_states.extract import commit_extraction

    out_ref, merge_ref = _ref(run, HIDDEN_STATES, RUN_DATASET), _ref(run, MERGE, RUN_DATASET)
    if (manifest := current_manifest(store, out_ref, _hs_params(run), [merge_ref])) is not None:
        return {"uri": store.uri(out_ref), **manifest["extra"]}
    return commit_extraction(store, merge_ref, out_ref, params=_hs_params(run))


# -- generation --------------------------------------------------------------------------------
def _sampling(run: Run) -> dict:
    s = run.config.generation.sampling
    return {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens, "thinking": s.thinking}


def _prompt_rows(store, ref) -> list[dict]:
    return [r for b in store.iter_batches(ref) for r in b.to_pylist()]


def _generated(store, ref, inputs: list) -> dict | None:
    """A complete generation stage made from these inputs: reuse it (paid work). Complete but from
    other inputs: invalidate the manifest; the writer then refuses to mix, never discards paid rows."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    want = [store.input_record(i)["manifest_sha256"] for i in inputs]
    if [i.get("manifest_sha256") for i in manifest.get("inputs", [])] == want:
        return {"uri": store.uri(ref), "rows": manifest["rows"], "reused": True}
    store.invalidate(ref)
    return None


def _finished(result: dict, what: str) -> dict:
    """A stage that stopped early (endpoints down, budget, retryable failures) raises, so Airflow
    retries it; committed rows are kept and skipped by the next attempt."""
    if result.get("stopped_reason") or not result.get("complete", True):
        raise RuntimeError(f"{what} stopped before completion: {result.get('stopped_reason')}; counts {result.get('counts')}")
    return {k: result[k] for k in ("uri", "counts", "tokens", "cost_usd") if k in result}


def sglang_endpoints(connection) -> list[str]:
    """SGLang endpoints from the sglang_default connection: extra `endpoints` (list or
    comma-separated), else the connection's own scheme://host:port."""
    from eagle3_data.generation.sglang import sglang_endpoints as parse

    extra = connection.extra_dejson or {}
    if extra.get("endpoints"):
        return parse(extra["endpoints"])
    scheme = connection.schema or "http"
    port = f":{connection.port}" if connection.port else ""
    return parse(f"{scheme}://{connection.host}{port}")


def generate_local(run: Run, store, dataset: str, endpoints: list[str]) -> dict:
    from eagle3_data.generation.progress import LogProgress
    from eagle3_data.generation.sglang import generate_local as generate

    prompts, ref = _ref(run, PROMPTS, dataset), _ref(run, LOCAL, dataset)
    if (reused := _generated(store, ref, [prompts])) is not None:
        return reused
    g = run.config.generation
    result = generate(
        store, ref, _prompt_rows(store, prompts), _tokenizer(run.config.tokenizer.source), endpoints, _sampling(run),
        in_flight_per_endpoint=g.local.in_flight_per_endpoint, rows_per_part=g.local.rows_per_part,
        model=run.config.model.name, inputs=[prompts], progress=LogProgress(log),
    )
    return _finished(result, f"generate_local {dataset}")


# -- publish -----------------------------------------------------------------------------------
def _generation_totals(store, ref) -> dict:
    """Rows, failures, tokens and USD of one generation stage, from its committed parts."""
    out = {"ok": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
    if not store.is_complete(ref):
        return out
    for batch in store.iter_batches(ref, columns=["status", "usage", "output_ids"]):
        for r in batch.to_pylist():
            out["ok" if r["status"] == "ok" else "failed"] += 1
            usage = r["usage"] or {}
            out["prompt_tokens"] += usage.get("prompt_tokens") or 0
            out["completion_tokens"] += usage.get("completion_tokens") or len(r["output_ids"] or [])
            out["cost_usd"] += usage.get("cost_usd") or 0.0
    out["cost_usd"] = round(out["cost_usd"], 6)
    return out


def _run_report(store, run_key: str, index: dict) -> str | None:
    """The UI's run-report index; left untouched when it already says the same (idempotent reruns)."""
    from eagle3_data.report_view import RUN_REPORT_NAME, run_report_ref, write_run_report

    if not index:
        return None
    ref = run_report_ref(run_key)
    if store.is_complete(ref) and store.get_json(ref, RUN_REPORT_NAME).get("datasets") == index:
        return store.uri(ref, RUN_REPORT_NAME)
    return write_run_report(store, run_key, index)


def publish(run: Run, store) -> dict:
    """Write the run report (per-dataset gates, counts, tokens, cost, hidden-state bytes, where
    everything is); raise GateFailed after writing it when any selected dataset failed, so the
    run ends failed and no Asset event announces it."""
    from eagle3_data.report_view import generation_lengths

    if run.dry_run:
        plans = {name: store.get_json(_ref(run, PLAN, name), PLAN_REPORT) for name in run.datasets}
        totals = {k: round(sum(p["estimate"][k] for p in plans.values()), 6) for k in ("prompt_tokens", "max_output_tokens", "max_overflow_usd")}
        uri = store.put_json(_ref(run, PLAN, RUN_DATASET), PLAN_REPORT, {"run_key": run.run_key, "datasets": plans, "totals": totals})
        log.info("dry run plan: %s", json.dumps({"datasets": plans, "totals": totals}, indent=1))
        return {"report_uri": uri, "totals": totals}

    gates = gate_results(run, store)
    datasets: dict[str, dict] = {}
    for name in gates:
        prompts = _ref(run, PROMPTS, name)
        datasets[name] = {
            "gate": gates[name],
            "prompts": store.read_manifest(prompts)["rows"] if store.is_complete(prompts) else None,
            "local": _generation_totals(store, _ref(run, LOCAL, name)),
            "overflow": _generation_totals(store, _ref(run, RECONSTRUCT, name)),
        }
    passed = [n for n in gates if gates[n]["passed"]]
    merge_ref, hs_ref = _ref(run, MERGE, RUN_DATASET), _ref(run, HIDDEN_STATES, RUN_DATASET)
    merged = store.read_manifest(merge_ref)["extra"] if passed and store.is_complete(merge_ref) else None
    hidden = None if run.skip_hidden_states or not merged else commit_hidden_states(run, store)
    index = {
        n: {
            "validation": gates[n]["report_uri"],
            "billing": store.uri(_ref(run, VALIDATE, n), BILLING_REPORT),
            "thresholds": vars(run.config.dataset(n).validation),
            "lengths": generation_lengths(store, [_ref(run, LOCAL, n), _ref(run, RECONSTRUCT, n)]),
            "generation": {"local": datasets[n]["local"], "overflow": datasets[n]["overflow"]},
        }
        for n in gates
        if gates[n]["report_uri"]
    }
    report_uri = _run_report(store, run.run_key, index)
    summary = {
        "run_key": run.run_key,
        "report_uri": report_uri,
        "datasets": datasets,
        "merged_uri": store.uri(merge_ref) if merged else None,
        "merged": merged and {"totals": merged["totals"], "shards": len(merged["shards"])},
        "hidden_states_uri": store.uri(hs_ref) if hidden else None,
        "hidden_states": hidden and {k: hidden.get(k) for k in ("totals", "layer_ids", "convention", "model", "dtype")},
        "cost_usd": round(sum(d["overflow"]["cost_usd"] for d in datasets.values()), 6),
    }
    summary_ref = _ref(run, "publish", RUN_DATASET)
    summary["summary_uri"] = store.uri(summary_ref, "summary.json")
    if not (store.is_complete(summary_ref) and store.get_json(summary_ref, "summary.json") == summary):
        store.put_json(summary_ref, "summary.json", summary)
        store.commit_files(summary_ref, ["summary.json"], params={"datasets": list(gates)})
    failed = [n for n in gates if not gates[n]["passed"]]
    if failed:
        raise GateFailed(
            f"run {run.run_key}: {len(failed)} dataset(s) failed their gate, nothing published: "
            + "; ".join(f"{n}: {', '.join(gates[n]['reasons'])} (report {gates[n]['report_uri']})" for n in failed)
            + f"; run summary: {summary['summary_uri']}"
        )
    return {**summary, "datasets": passed}


def generate_overflow(run: Run, store, dataset: str, connection) -> dict:
    """OpenRouter (base URL: the connection's host, key: its password; never logged)."""
    from eagle3_data.generation.openrouter import generate_overflow as generate
    from eagle3_data.generation.progress import LogProgress

    prompts, ref = _ref(run, PROMPTS, dataset), _ref(run, OVERFLOW, dataset)
    if (reused := _generated(store, ref, [prompts])) is not None:
        return reused
    base_url = connection.host if "://" in (connection.host or "") else f"https://{connection.host or 'openrouter.ai/api/v1'}"
    o = run.config.generation.overflow
    result = generate(
        store, ref, _prompt_rows(store, prompts), _tokenizer(run.config.tokenizer.source), base_url,
        connection.password or "", o.model, o.provider, o.max_usd, sampling=_sampling(run),
        concurrency=o.concurrency, rows_per_part=o.rows_per_part, inputs=[prompts], progress=LogProgress(log),
    )
    if result.get("stopped_reason") in ("budget", "credits", "unauthorized"):
        raise UserError(
            f"generate_overflow {dataset} stopped: {result['stopped_reason']} (spent ${result.get('cost_usd', 0):.4f} "
            f"of max_usd {o.max_usd}); committed rows are kept and skipped on rerun"
        )
    return _finished(result, f"generate_overflow {dataset}")


# -- load + route ------------------------------------------------------------------------------
def load_route(run: Run, store, dataset: str) -> dict:
    """Read the dataset's prompts (its date partition for scheduled runs), give each a stable
    sample_id and a route (local | overflow | both); refused rows go to rejects.json. In a dry run
    nothing is written but the plan: counts, token and cost estimates."""
    import hashlib

    from eagle3_data.generation.routing import assign_routes
    from eagle3_data.prompts import load_prompts

    ds, g = run.config.dataset(dataset), run.config.generation
    loaded = load_prompts(ds.prompts, dataset, date=run.date, sampling=_sampling(run), repeats=g.repeats, client=store.client)
    rows = assign_routes(loaded.rows, **vars(run.config.routing))
    counts = {"prompts": len(rows), "rejects": len(loaded.rejects)}
    for r in rows:
        counts[r["route"]] = counts.get(r["route"], 0) + 1
    if run.dry_run:
        plan = {"dataset": dataset, "source": ds.prompts, "date": run.date, "counts": counts, "estimate": _estimate(run, rows)}
        return {"plan_uri": store.put_json(_ref(run, PLAN, dataset), PLAN_REPORT, plan), **plan}
    ref = _ref(run, PROMPTS, dataset)
    params = {
        "source": ds.prompts, "date": run.date, "sampling": _sampling(run), "repeats": g.repeats,
        "routing": vars(run.config.routing), "rows_sha256": hashlib.sha256(_canonical(rows).encode()).hexdigest(),
    }
    if current_manifest(store, ref, params, []) is None:
        with store.writer(ref, "prompts", rows_per_part=max(1, len(rows)), params=params, fresh=True) as w:
            w.write(rows)
            store.put_json(ref, "rejects.json", loaded.rejects)
            w.commit(extra={"counts": counts}, files=["rejects.json"])
    if not rows:
        raise UserError(f"dataset {dataset}: no usable prompts in {ds.prompts} (date {run.date}); rejects: {store.uri(ref, 'rejects.json')}")
    return {"uri": store.uri(ref), "counts": counts}


def _estimate(run: Run, rows: list[dict]) -> dict:
    """Upper bounds: every sample uses max_new_tokens; overflow priced at the configured rates."""
    from eagle3_data.chat_format import get_output_format

    fmt = get_output_format(_tokenizer(run.config.tokenizer.source))
    s, price = run.config.generation.sampling, run.config.generation.overflow.price_usd_per_mtok
    prompt_tokens = {"local": 0, "overflow": 0}
    for r in rows:
        n = len(fmt.generation_prompt_ids(json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None, thinking=s.thinking))
        for side in ("local", "overflow"):
            if r["route"] in (side, "both"):
                prompt_tokens[side] += n
    overflow_n = sum(r["route"] in ("overflow", "both") for r in rows)
    usd = (prompt_tokens["overflow"] * price["prompt"] + overflow_n * s.max_new_tokens * price["completion"]) / 1e6
    return {
        "prompt_tokens": sum(prompt_tokens.values()),
        "max_output_tokens": len(rows) * s.max_new_tokens + sum(r["route"] == "both" for r in rows) * s.max_new_tokens,
        "max_overflow_usd": round(min(usd, run.config.generation.overflow.max_usd), 6),
    }

