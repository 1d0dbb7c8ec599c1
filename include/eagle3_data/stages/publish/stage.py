"""Stage 8, publish: the run report and summary (per-dataset gates, counts, tokens, cost,
hidden-state bytes, where everything is). A run whose selected datasets did not all pass ends
failed here, after writing them, so nobody trains on it unnoticed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from eagle3_data.errors import GateFailed
from eagle3_data.extraction_params import hidden_states_params
from eagle3_data.runs.results import PublishResult
from eagle3_data.runs.reuse import reusable
from eagle3_data.runs.run import Run, bulk_tokenizer_for, log, stage_ref
from eagle3_data.runs.upstream import gate_results
from eagle3_data.stages import (
    AUDIT,
    AUDIT_DATASET,
    BILLING_REPORT,
    HIDDEN_STATES,
    LOCAL,
    MERGE,
    OVERFLOW,
    PLAN,
    PLAN_REPORT,
    PROBE,
    PROMPTS,
    PUBLISH,
    RECONSTRUCT,
    RUN_DATASET,
    VALIDATE,
)
from eagle3_data.storage_estimate import storage_estimate

SUMMARY = "summary.json"


def _generation_totals(store, ref) -> dict[str, Any]:
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


def _probe_figures(run: Run, store, hs_ref) -> dict[str, Any] | None:
    """The probe's figures and learning curve, when it ran on this extraction with these params."""
    from eagle3_data.runs.upstream import probe_params
    from eagle3_data.stages import PROBE_REPORT

    ref = stage_ref(run, PROBE, RUN_DATASET)
    if run.config.probe.when == "never" or reusable(store, ref, [hs_ref], probe_params(run)) is None:
        return None
    report = store.get_json(ref, PROBE_REPORT)
    keys = (
        "simulated_acceptance",
        "eval_loss",
        "first_draft",
        "last_state_fit",
        "acc",
        "full_acc",
        "coverage",
        "curve",
        "train_samples",
        "eval_samples",
        "eval_tokens",
        "draft_vocab_size",
        "device",
        "seconds",
        "verdict",
        "verdict_rule",
        "export_check",
        "data_quality",
    )
    return {"uri": store.uri(ref, PROBE_REPORT), "steps": report["config"]["steps"], **{k: report.get(k) for k in keys}}


def verdicts(hidden: dict[str, Any] | None, probe: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The checks' verdicts, for the top of the run report: the extraction's self-check (its
    log-probabilities against the local engine's own: a shard that fails it is never committed),
    the check of the export the probe trained on (through speculators' reader), and the probe's
    verdict; each {check, verdict, rule}."""
    out = []
    if hidden is not None:
        lc = hidden.get("logprob_check")
        if not lc or not lc.get("compared_samples"):
            skipped = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in ((lc or {}).get("not_compared") or {}).items())
            out.append(
                {
                    "check": "extraction",
                    "verdict": "not compared",
                    "rule": "no answer with the engine's own log-probabilities to compare"
                    + (f" (not compared: {skipped})" if skipped else ""),
                }
            )
        else:
            out.append(
                {
                    "check": "extraction",
                    "verdict": "pass",
                    "rule": f"{lc['compared_samples']} answers ({lc['compared_tokens']} tokens) within "
                    f"{lc['tolerance']} nats of the engine's own log-probabilities (worst mean "
                    f"{lc['worst_mean_abs_diff']:.2g})",
                }
            )
    if probe is not None:
        check = probe.get("export_check")
        if check is not None:
            rule = (
                check.get("error")
                if check.get("verdict") != "pass"
                else f"{check.get('rows_checked')} rows through speculators' reader, worst |log p difference| "
                f"{(check.get('logprob') or {}).get('max_abs_diff', 0):.2g} nats"
            )
            out.append({"check": "export (the probe's)", "verdict": check.get("verdict"), "rule": rule})
        if probe.get("verdict"):
            out.append({"check": "probe", "verdict": probe["verdict"], "rule": probe.get("verdict_rule")})
    return out


def _probe_not_run(when: str) -> str:
    """Why the report of an extracted run has no probe verdict, as far as publish can tell (the probe
    task's skip message or error says which case it was)."""
    if when == "never":
        return "Not run: the probe is off (config probe.when / param probe: never)."
    if when == "auto":
        return (
            "Not run: probe.when auto runs it on a worker with a GPU and skips it on one without, or when "
            "its first steps pace past probe.budget_s (the probe task's log says which); param probe=always "
            "runs it on any worker."
        )
    return "Not run on this extraction: the probe task failed or did not finish (its log says why)."


def _policy_every_row(run: Run, store, hs_ref, hidden: dict[str, Any]) -> dict[str, Any]:
    """The policy check over every sampled answer the extraction scored (policy_check.every_row_gate),
    with the nucleus counts of its committed figures (`hidden`: the extraction manifest's extra)."""
    from eagle3_data.policy_check import Thresholds, every_row_gate, nucleus_counts
    from eagle3_data.stages import SAMPLE_MEANS

    return every_row_gate(
        store.get_json(hs_ref, SAMPLE_MEANS),
        Thresholds.from_config(run.config.validation),
        nucleus_counts(hidden["logprobs"]["sources"]),
    )


def _run_report(store, run_key: str, index: dict[str, Any], stand_ins, training: dict[str, Any]) -> str | None:
    """The UI's run-report index; left untouched when it already says the same (idempotent reruns)."""
    from eagle3_data.report import RUN_REPORT_NAME, run_report_ref, write_run_report

    if not index:
        return None
    ref = run_report_ref(run_key)
    if (
        store.is_complete(ref)
        and (old := store.get_json(ref, RUN_REPORT_NAME)).get("datasets") == index
        and old.get("stand_ins", []) == list(stand_ins)
        and old.get("training", {}) == training
    ):
        return store.uri(ref, RUN_REPORT_NAME)
    return write_run_report(store, run_key, index, stand_ins=stand_ins, training=training)


def _plan(run: Run, store) -> PublishResult:
    """A dry run: the run's plan (plan.run_plan, what `eagle3-data plan` prints) from each
    dataset's, written where the report tab shows it, its table logged."""
    from eagle3_data.plan import format_plan, run_plan

    plans = {name: store.get_json(stage_ref(run, PLAN, name), PLAN_REPORT) for name in run.datasets}
    # each routing strategy over the whole run (the datasets share endpoints and provider)
    # (each dataset's times at its own rates: they may come from its previous run's manifests)
    plan = run_plan(run, plans)
    uri = store.put_json(stage_ref(run, PLAN, RUN_DATASET), PLAN_REPORT, plan)
    log.info("dry run plan (%s):\n%s", uri, format_plan(plan))
    log.debug("dry run plan: %s", json.dumps(plan, indent=1))
    return PublishResult(
        run_key=run.run_key,
        report_uri=uri,
        summary_uri=None,
        datasets=list(run.datasets),
        changed=False,
        totals=plan["totals"],
    )


def _conversation_figures(store, run: Run, dataset: str) -> dict[str, Any]:
    """`conversations`: each generation stage's samples figures when it ran in rounds
    (conversations.figures, in its manifest), by path; nothing otherwise."""
    out = {}
    for path, stage in (("local", LOCAL), ("overflow", OVERFLOW)):
        ref = stage_ref(run, stage, dataset)
        if store.is_complete(ref) and (figures := (store.read_manifest(ref).get("extra") or {}).get("conversations")):
            out[path] = figures
    return {"conversations": out} if out else {}


def _trajectory_counts(merged: dict[str, Any] | None, dataset: str) -> dict[str, Any]:
    """`trajectories`: what the merge made of the dataset's trajectories (samples kept whole, kept
    cut, dropped; turn rows folded, records, dropped: merge._fold), when it had any."""
    counts = {
        k: v for k, v in ((merged or {}).get("datasets", {}).get(dataset) or {}).items() if k.startswith("trajectory_")
    }
    return {"trajectories": counts} if counts else {}


def _image_counts(store, prompts_ref) -> dict[str, Any]:
    """`images`: the dataset's image prompts (rows, images, media tokens, rows refused for an image:
    prompts.IMAGE_COUNTS, as the prompts stage counted them), when it had any."""
    from eagle3_data.stages import IMAGE_COUNTS

    if not store.is_complete(prompts_ref):
        return {}
    counts = (store.read_manifest(prompts_ref).get("extra") or {}).get("counts") or {}
    found = {k: counts[k] for k in IMAGE_COUNTS if counts.get(k)}
    return {"images": found} if found else {}


def publish(run: Run, store, failed: Mapping[str, str] | None = None) -> PublishResult:
    """Write the run report and summary, whatever happened upstream (the DAG runs this task once
    everything else is done: the report matters most for a run that failed). Then raise GateFailed
    when anything is missing for training (a dataset's gate, the merge, the hidden states), so the
    run ends failed and no Asset event announces it. `changed` says whether the summary is new
    (the DAG emits the Asset event only then). `failed`: datasets whose tasks failed in this DAG
    run (`gate_results`)."""
    from eagle3_data.report.data import decode_least_likely, generation_lengths

    if run.dry_run:
        return _plan(run, store)

    gates = gate_results(run, store, failed)
    datasets: dict[str, dict[str, Any]] = {}
    for name, gate in gates.items():
        prompts = stage_ref(run, PROMPTS, name)
        datasets[name] = {
            "gate": gate.as_dict(),
            "prompts": store.read_manifest(prompts)["rows"] if store.is_complete(prompts) else None,
            "local": _generation_totals(store, stage_ref(run, LOCAL, name)),
            "overflow": _generation_totals(store, stage_ref(run, RECONSTRUCT, name)),
            **_image_counts(store, prompts),
        }
    passed = [n for n, g in gates.items() if g.passed]
    merge_ref, hs_ref = stage_ref(run, MERGE, RUN_DATASET), stage_ref(run, HIDDEN_STATES, RUN_DATASET)
    merged = store.read_manifest(merge_ref)["extra"] if passed and store.is_complete(merge_ref) else None
    index = {
        n: {
            "validation": g.report_uri,
            "billing": store.uri(stage_ref(run, VALIDATE, n), BILLING_REPORT),
            "thresholds": run.config.dataset(n).validation.rates(),
            "lengths": generation_lengths(store, [stage_ref(run, LOCAL, n), stage_ref(run, RECONSTRUCT, n)]),
            "generation": {
                "local": datasets[n]["local"],
                "overflow": datasets[n]["overflow"],
                **_conversation_figures(store, run, n),
                **_trajectory_counts(merged, n),
                **_image_counts(store, stage_ref(run, PROMPTS, n)),
            },
        }
        for n, g in gates.items()
        if g.report_uri
    }
    problems = [f"{n}: {', '.join(g.reasons)} (report {g.report_uri})" for n, g in gates.items() if not g.passed]
    if not store.is_complete(stage_ref(run, AUDIT, AUDIT_DATASET)):
        problems.insert(0, "the tokenizer audit did not pass (see task audit_tokenizer)")
    if passed and merged is None:
        problems.append("merge did not complete (see task merge)")
    hidden = None
    if merged and not run.skip_hidden_states:
        committed = reusable(store, hs_ref, [merge_ref], hidden_states_params(run))
        hidden = committed and committed["extra"]
        if hidden is None:
            problems.append(
                f"hidden states: {store.uri(hs_ref)} is not committed for this merge and its params "
                "(see tasks extract_hidden_states and commit_hidden_states)"
            )
    every_row = _policy_every_row(run, store, hs_ref, hidden) if hidden and hidden.get("logprobs") else None
    if every_row is not None and not every_row["passed"]:
        problems.append(
            "policy on every row (the extraction's target log-probabilities): " + "; ".join(every_row["reasons"])
        )
    training = {
        "policy_every_row": every_row and {k: every_row[k] for k in ("passed", "reasons", "notes")},
        "draft_vocab": (merged or {}).get("draft_vocab"),
        "hidden_states_estimate": storage_estimate(run, int(merged["totals"].get("tokens", 0))) if merged else None,
        "hidden_states_bytes": (hidden or {}).get("totals", {}).get("bytes"),
        # the target's log-probabilities of the trained tokens per path, and the extraction's self-check
        "logprobs": decode_least_likely((hidden or {}).get("logprobs"), lambda: bulk_tokenizer_for(run, store)),
        "logprob_check": (hidden or {}).get("logprob_check"),
        "probe": _probe_figures(run, store, hs_ref) if hidden else None,  # the drafter's verdict, when it ran
    }
    if hidden and training["probe"] is None:
        training["probe_not_run"] = _probe_not_run(run.config.probe.when)
    training["verdicts"] = verdicts(hidden, training["probe"])  # what the report opens with
    report_uri = _run_report(store, run.run_key, index, run.config.stand_ins, training)
    summary_ref = stage_ref(run, PUBLISH, RUN_DATASET)
    summary = {
        "run_key": run.run_key,
        "report_uri": report_uri,
        "datasets": datasets,
        "merged_uri": store.uri(merge_ref) if merged else None,
        "merged": merged and {"totals": merged["totals"], "shards": len(merged["shards"])},
        "hidden_states_uri": store.uri(hs_ref) if hidden else None,
        "hidden_states": hidden
        and {k: hidden.get(k) for k in ("totals", "layer_ids", "convention", "last_hidden_norm", "model", "dtype")},
        "training": training,
        "cost_usd": round(sum(d["overflow"]["cost_usd"] for d in datasets.values()), 6),
        "summary_uri": store.uri(summary_ref, SUMMARY),
        "stand_ins": list(run.config.stand_ins),
        # whether the run passed: a failed run that is fixed writes a new summary (and publishes)
        "passed": not problems,
    }
    # a dataset whose tasks failed in this run (a refusal) left its stages as an earlier run committed
    # them: the summary, that run's published result, is not this run's to rewrite
    changed = not (store.is_complete(summary_ref) and store.get_json(summary_ref, SUMMARY) == summary)
    changed = changed and not any(g.failed_task for g in gates.values())
    if changed:
        store.put_json(summary_ref, SUMMARY, summary)
        store.commit_files(summary_ref, [SUMMARY], params={"datasets": list(gates)})
    if problems:
        raise GateFailed(
            f"run {run.run_key}: nothing published: " + "; ".join(problems) + f"; run summary: {summary['summary_uri']}"
        )
    return PublishResult(
        run_key=run.run_key,
        report_uri=report_uri,
        summary_uri=summary["summary_uri"],
        datasets=passed,
        merged_uri=summary["merged_uri"],
        hidden_states_uri=summary["hidden_states_uri"],
        cost_usd=summary["cost_usd"],
        changed=changed,
        summary=summary,
        stand_ins=list(run.config.stand_ins),
    )
