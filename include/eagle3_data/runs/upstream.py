"""What a stage reads of other stages' committed outputs: the gate's outcome, the policy check's
figures and routes, the observed rates, the merged shards, and the params that locate the
hidden states and the probe.

These reads are the contracts between stages. They live here, below every stage, so that no
stage imports another: a stage that needs an upstream result asks this module, and a change to
how one stage commits its output shows up in one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from eagle3_data.runs.results import Gate
from eagle3_data.runs.run import Run, stage_ref
from eagle3_data.stages import LOCAL, OVERFLOW, POLICY, POLICY_REPORT, PROMPTS, RECONSTRUCT, VALIDATE, VALIDATION_REPORT
from eagle3_data.storage import ArtifactStore, StageRef


def gate_results(run: Run, store, failed: Mapping[str, str] | None = None) -> dict[str, Gate]:
    """Each dataset's gate as committed in S3 (missing: its validate never completed). `failed`:
    datasets whose own tasks failed in this DAG run, by the failed task (a refusal, a stage that
    stopped past its retries): a gate committed by an earlier run is not this run's, so such a
    dataset fails here, naming the task, instead of being merged and published on old stages."""
    out = {}
    for name in run_datasets(run, store):
        ref = stage_ref(run, VALIDATE, name)
        if store.is_complete(ref):
            out[name] = gate_from_manifest(store.read_manifest(ref), store.uri(ref, VALIDATION_REPORT))
        else:
            out[name] = Gate(passed=False, reasons=["validation did not complete (see the failed task)"])
        if out[name].passed and failed and name in failed:
            out[name] = replace(
                out[name],
                passed=False,
                reasons=[f"task {failed[name]} failed in this run: its committed stages are an earlier run's"],
                failed_task=failed[name],
            )
    return out


def row_routes(run: Run, store, dataset: str) -> dict[str, str]:
    """The route of each generation row of the dataset: its prompt's (`local`, `overflow`, `both`:
    calibration). When the stages asked for a conversation's turns in rounds
    (generation.conversations) the rows are turns, not prompts: a turn is `both` when both paths
    generated it (its id covers its prompt, so they answered one prompt), else its path's."""
    from eagle3_data.conversations import needs_rounds

    g = run.config.generation
    if not needs_rounds(g.regenerate, g.history):
        return {
            r["sample_id"]: r["route"]
            for r in table_rows(store, stage_ref(run, PROMPTS, dataset), ["sample_id", "route"])
        }
    ids = {
        side: {r["sample_id"] for r in table_rows(store, stage_ref(run, stage, dataset), ["sample_id"])}
        for side, stage in (("local", LOCAL), ("overflow", RECONSTRUCT))
        if store.is_complete(stage_ref(run, stage, dataset))
    }
    local, overflow = ids.get("local", set()), ids.get("overflow", set())
    return {
        **dict.fromkeys(local, "local"),
        **dict.fromkeys(overflow, "overflow"),
        **dict.fromkeys(local & overflow, "both"),
    }


def policy_summary(run: Run, store, dataset: str) -> dict[str, Any] | None:
    """The committed figures of the dataset's policy check, None when it has none."""
    ref = stage_ref(run, POLICY, dataset)
    if not store.is_complete(ref):
        return None
    return store.get_json(ref, POLICY_REPORT)


def rate_inputs(run: Run, store, dataset: str) -> dict[str, Any]:
    """What each side's rate is computed from, and where it came from.

    Per side, the newest committed generation manifest of this dataset in another run that
    recorded its observed latency (`extra.latency_s_mean`: mean seconds per answered sample):
    local takes that run's in flight per endpoint (what the endpoints reported or the config set,
    with the latency it produced: SGLang's latency grows with its batch) times this run's
    `routing.local_endpoints`; overflow takes this run's concurrency over that run's latency (a
    provider's latency does not depend on how many requests one client has open). A side with
    no such manifest uses the config (`routing.local_latency_s`, `overflow_latency_s`,
    `generation.local.in_flight_per_endpoint` or its default). `source` names the manifest or "config".
    """
    from eagle3_data.engines.client import DEFAULT_IN_FLIGHT

    r, g = run.config.routing, run.config.generation
    local = {
        "endpoints": r.local_endpoints,
        "in_flight_per_endpoint": g.local.in_flight_per_endpoint or DEFAULT_IN_FLIGHT,
        "latency_s": r.local_latency_s,
        "source": "config",
    }
    overflow = {"concurrency": g.overflow.concurrency, "latency_s": r.overflow_latency_s, "source": "config"}
    if (prev := previous_generation(store, run.run_key, LOCAL, dataset)) is not None:
        uri, extra = prev
        in_flight = [n for n in (extra.get("in_flight") or {}).values() if isinstance(n, int) and n > 0]
        local.update(latency_s=extra["latency_s_mean"], source=uri)
        if in_flight:
            local["in_flight_per_endpoint"] = round(sum(in_flight) / len(in_flight))
    if (prev := previous_generation(store, run.run_key, OVERFLOW, dataset)) is not None:
        overflow.update(latency_s=prev[1]["latency_s_mean"], source=prev[0])
    return {"local": local, "overflow": overflow}


def rates(inputs: dict[str, Any]):
    """Samples/s of each side (generation.balance.side_rates) from `rate_inputs`."""
    from eagle3_data.balance import side_rates

    lo, ov = inputs["local"], inputs["overflow"]
    return side_rates(
        local_endpoints=lo["endpoints"],
        in_flight_per_endpoint=lo["in_flight_per_endpoint"],
        local_latency_s=lo["latency_s"],
        overflow_concurrency=ov["concurrency"],
        overflow_latency_s=ov["latency_s"],
    )


def merged_shards(store: ArtifactStore, ref: StageRef, manifest: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The shard refs of a committed merge stage, from its manifest (never from a listing);
    `manifest`: the caller's copy of it, if it has one."""
    return list((manifest or store.read_manifest(ref)).get("extra", {}).get("shards", []))


def probe_params(run: Run) -> dict[str, Any]:
    """What decides the verdict: every probe choice but whether it runs and its time budget."""
    return run.config.probe.model_dump(exclude={"when", "budget_s"})


def gate_from_manifest(manifest: dict[str, Any], report_uri: str | None) -> Gate:
    g = manifest["extra"]["gate"]
    return Gate(
        passed=g["passed"],
        reasons=list(g["reasons"]),
        report_uri=report_uri,
        thresholds=g.get("thresholds") or {},
        notes=list(g.get("notes") or []),
        unvalidated_overflow=bool(g.get("unvalidated_overflow")),
    )


def run_datasets(run: Run, store) -> list[str]:
    """The datasets this run merges and reports: the selected ones, plus datasets of the same run
    key that an earlier run already validated and passed (a `datasets=[X]` trigger reruns X and
    keeps the others). A dataset left out of the selection after failing its gate is dropped."""
    earlier = [
        n
        for n in store.datasets(run.run_key, VALIDATE)
        if n not in run.datasets
        and n in run.config.dataset_names
        and store.read_manifest(stage_ref(run, VALIDATE, n))["extra"]["gate"]["passed"]
    ]
    return [n for n in run.config.dataset_names if n in run.datasets or n in earlier]


def table_rows(store: ArtifactStore, ref: StageRef, columns: list[str]) -> Iterator[dict[str, Any]]:
    for batch in store.iter_batches(ref, columns=columns):
        yield from batch.to_pylist()


def previous_generation(store, run_key: str, stage: str, dataset: str) -> tuple[str, dict[str, Any]] | None:
    """(manifest URI, its `extra`) of the newest committed `stage` of `dataset` in a run other
    than `run_key` whose manifest recorded `latency_s_mean`, made on a real engine (`earlier_stages`);
    None when there is none."""
    from eagle3_data.plan import earlier_stages

    for ref, manifest in earlier_stages(store, run_key, stage, dataset):
        extra = manifest.get("extra") or {}
        latency = extra.get("latency_s_mean")
        if isinstance(latency, (int, float)) and latency > 0:
            return store.uri(ref), extra
    return None
