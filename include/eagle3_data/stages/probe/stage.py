"""Stage 8 (optional), the probe: the drafter's verdict on the run's hidden states
(eagle3_data.stages.probe.drafter), on the GPU queue after the extraction's commit. It reads the first shards of
the extraction until it holds `samples + eval_samples` rows (the merge shuffled them, so these are
a random subset and the cost is bounded whatever the run's size; one shard on local disk at a
time besides the export), exports them for speculators
with the merge's draft vocabulary, and writes `probe.json` under runs/RUN_KEY/probe/all."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from eagle3_data.config import resolve_source
from eagle3_data.runs.results import ProbeResult, ProbeSkipped
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, log, stage_ref
from eagle3_data.runs.upstream import probe_params
from eagle3_data.stages import HIDDEN_STATES, MERGE, PROBE, PROBE_REPORT, RUN_DATASET


def probe(run: Run, store) -> ProbeResult | ProbeSkipped:
    """The probe on the committed extraction (reused when it ran on it with these params), or why
    not: off, nothing extracted, `auto` on a worker without a GPU (on a CPU the defaults pace past
    the budget), or, under `auto`, a first pace past the budget (where `always` fails: OverBudget)."""
    from eagle3_data.draft_vocab import is_file_of
    from eagle3_data.exports.check import StageShards
    from eagle3_data.exports.shards import ShardReader
    from eagle3_data.exports.speculators_export import export_speculators
    from eagle3_data.stages.probe.drafter import ExportCheck, OverBudget, default_device, probe_export

    started, p = time.monotonic(), run.config.probe
    hs_ref, out_ref = stage_ref(run, HIDDEN_STATES, RUN_DATASET), stage_ref(run, PROBE, RUN_DATASET)
    if p.when == "never":
        return ProbeSkipped("probe off (config probe.when / param probe: never)")
    if run.dry_run or run.skip_hidden_states or not store.is_complete(hs_ref):
        return ProbeSkipped("nothing extracted to probe (a dry run, hidden states skipped, or no committed extraction)")
    if (manifest := settle(run, store, out_ref, [hs_ref], probe_params(run), what="probe")) is not None:
        return ProbeResult(store.uri(out_ref, PROBE_REPORT), reused=True, **manifest["extra"])
    if (device := default_device()) != "cuda" and p.when == "auto":
        return ProbeSkipped(
            "probe.when auto: this worker has no GPU, and on a CPU the probe's defaults pace past probe.budget_s "
            f"({p.budget_s:.0f} s; benchmarks/gpu_probe.py); param probe=always runs it here"
        )
    manifest, merge_ref = store.read_manifest(hs_ref), stage_ref(run, MERGE, RUN_DATASET)
    with tempfile.TemporaryDirectory(prefix="eagle3-probe-") as tmp:
        work = Path(tmp)
        for f in store.read_manifest(merge_ref)["files"]:  # the draft vocabulary the extraction's merge counted
            if is_file_of("speculators", f["name"]):
                store.get_file(merge_ref, f["name"], work / "export" / f["name"], sha256=f["sha256"])

        def first_shards():
            """The extraction's shards in order, one on disk at a time, until enough rows."""
            rows = 0
            for f in manifest["files"]:
                if f["name"].endswith(".safetensors") and rows < p.samples + p.eval_samples:
                    path = store.get_file(hs_ref, f["name"], work / "shards" / f["name"], sha256=f["sha256"])
                    rows += len(ShardReader(path))
                    yield path
                    path.unlink()

        export_speculators(first_shards(), work / "export", source=store.uri(hs_ref))
        model = Path(resolve_source(run.config.model.source))
        budget_s = p.budget_s - (time.monotonic() - started)  # the shards' download counts
        # the export checked through speculators' reader against the extraction (the shards of its
        # sampled rows fetched again, one by one): the verdict's alignment
        (work / "check").mkdir()
        shards = StageShards(store, hs_ref, work / "check")
        try:
            report = probe_export(
                work / "export",
                model,
                p,
                device=device,
                budget_s=budget_s,
                check=ExportCheck(shards, run.config.export.check_samples),
            )
        except OverBudget as exc:
            if p.when != "auto":
                raise
            log.warning("%s", exc)
            return ProbeSkipped(f"probe.when auto: {exc}")
    report["device"] = device
    uri = store.put_json(out_ref, PROBE_REPORT, report)
    extra = {
        "verdict": report["verdict"],
        "verdict_rule": report["verdict_rule"],
        "simulated_acceptance": report["simulated_acceptance"],
        "acc": report["acc"],
        "coverage": report["coverage"],
    }
    store.commit_files(out_ref, [PROBE_REPORT], params=probe_params(run), inputs=[hs_ref], extra=extra)
    log.info(
        "probe: verdict %s (%s); simulated acceptance %.3f, acc %s, coverage %.3f (%s)",
        report["verdict"],
        report["verdict_rule"],
        report["simulated_acceptance"],
        [round(a, 3) for a in report["acc"]],
        report["coverage"],
        uri,
    )
    return ProbeResult(uri, **extra)
