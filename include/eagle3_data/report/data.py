"""A run's report data: the run-report index, its loader from S3, and the statistics on it.

The DAG's publish step writes a small index (`write_run_report`) naming, per dataset, the S3
objects that hold the validation report and the overflow billing check, with token-length and
generation totals inline. `load_run_report` reads the index and every object it names into a
`RunReport`; `render.py` turns that into HTML or Markdown. Nothing here knows about markup, and
nothing here imports Airflow, so the numbers can be tested, and served as JSON, on their own.

The mismatch classes are validate.py's `CLASSES`, read from there at each call (`classes()`),
never copied, so a class the gate learns shows up here, and on the page, without an edit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from eagle3_data.errors import UserError

if TYPE_CHECKING:  # storage imports boto3 + pyarrow: the CLI's validate renders reports without them
    from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_data.stages import validate
from eagle3_data.storage.refs import MissingBucket, StorageError, StorageUnavailable, check_name

RUN_REPORT_STAGE = "report"
RUN_REPORT_DATASET = "run"
RUN_REPORT_NAME = "run_report.json"
RUN_REPORT_FORMAT = "eagle3-run-report/1"
ARTIFACT_KINDS = ("validation", "billing")  # stage reports a dataset entry points to (s3:// URIs)
INLINE_KINDS = ("lengths", "generation")  # small summaries a dataset entry holds inline
# Storage errors that mean "S3 cannot answer" rather than "this object is not there": loading raises
# them instead of recording a gap, and the plugin answers 503 for them.
STORAGE_OUTAGES = (StorageUnavailable, MissingBucket)
# The one class whose rate threshold is not named `max_<class>_rate`; every other non-exact class
# without a written threshold fails the gate on any sample (validate.py's rule), i.e. at 0.0.
RATE_THRESHOLD_ALIASES = {"bpe_only": "max_bpe_mismatch_rate"}


def classes() -> tuple[str, ...]:
    """The gate's mismatch classes, in validate.py's order (least to most severe)."""
    return tuple(validate.CLASSES)


# -- index ---------------------------------------------------------------------------------------
def run_report_ref(run_key: str) -> StageRef:
    """Where the index lives: `runs/{run_key}/report/run/run_report.json`."""
    from eagle3_data.storage import StageRef

    return StageRef(run_key, RUN_REPORT_STAGE, RUN_REPORT_DATASET)


def write_run_report(
    store: ArtifactStore,
    run_key: str,
    datasets: Mapping[str, Mapping[str, Any]],
    *,
    dag_id: str | None = None,
    run_id: str | None = None,
    stand_ins: Sequence[str] = (),
    training: Mapping[str, Any] | None = None,
) -> str:
    """Write and commit the index. `datasets` maps name -> {validation: uri, billing?: uri,
    thresholds?: {name: number}, lengths?: `generation_lengths(...)`, generation?: {local: totals,
    overflow: totals, conversations?: figures per path, trajectories?: the merge's trajectory_*
    counts}} (totals: ok, failed, prompt_tokens, completion_tokens, cost_usd). The billing report
    holds the completion check and, under `prompt`, the prompt check (stages.validate.billing).
    Returns the index URI."""
    index = {
        "format": RUN_REPORT_FORMAT,
        "run_key": run_key,
        "dag_id": dag_id,
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "datasets": {name: dict(entry) for name, entry in datasets.items()},
        "stand_ins": list(stand_ins),  # what the run ran on instead of the real thing (the page says so)
        # the training data as a whole: the draft vocabulary's coverage, the hidden states' bytes (estimated, written)
        "training": dict(training or {}),
    }
    _check_index(index, store, run_key)
    ref = run_report_ref(run_key)
    uri = store.put_json(ref, RUN_REPORT_NAME, index)
    store.commit_files(ref, [RUN_REPORT_NAME], params={"datasets": sorted(datasets)})
    return uri


def _check_index(index: Any, store: ArtifactStore, run_key: str) -> None:
    """Refuse an index this version cannot read, or one pointing outside the store's runs/: the
    page must never be made to fetch an arbitrary object."""
    where = store.uri(run_report_ref(run_key), RUN_REPORT_NAME)
    if not isinstance(index, dict) or index.get("format") != RUN_REPORT_FORMAT:
        raise UserError(f"{where}: format is not {RUN_REPORT_FORMAT!r}")
    if index.get("run_key") != run_key:
        raise UserError(f"{where}: run_key {index.get('run_key')!r} is not {run_key!r}")
    datasets = index.get("datasets")
    if not isinstance(datasets, dict) or not datasets:
        raise UserError(f"{where}: datasets must be a non-empty object")
    for name, entry in datasets.items():
        check_name(name, f"{where} dataset name")
        if not isinstance(entry, dict) or not isinstance(entry.get("validation"), str):
            raise UserError(f"{where}: datasets.{name}.validation must be the report's s3:// URI")
        for kind in ARTIFACT_KINDS:
            if entry.get(kind) is not None:
                _ref_of(store, entry[kind], f"{where}: datasets.{name}.{kind}")
        for kind in INLINE_KINDS:
            if not isinstance(entry.get(kind) or {}, dict):
                raise UserError(f"{where}: datasets.{name}.{kind} must be an object")
        thresholds = entry.get("thresholds", {})
        if not isinstance(thresholds, dict) or not all(is_number(v) for v in thresholds.values()):
            raise UserError(f"{where}: datasets.{name}.thresholds must map names to numbers")


def _ref_of(store: ArtifactStore, uri: str, field_name: str) -> tuple[StageRef, str]:
    """The (StageRef, file name) of an artifact URI, refusing anything outside this store's runs/."""
    from eagle3_data.storage import StageRef

    base = f"s3://{store.bucket}/{store.prefix + '/' if store.prefix else ''}runs/"
    match = re.fullmatch(re.escape(base) + r"([^/]+)/([^/]+)/([^/]+)/([^/]+)", uri or "")
    if not match:
        raise UserError(f"{field_name}: {uri!r} is not an artifact of {base}{{run_key}}/{{stage}}/{{dataset}}/{{name}}")
    return StageRef(match[1], match[2], match[3]), match[4]


# -- the report ----------------------------------------------------------------------------------
@dataclass
class DatasetReport:
    """What the report shows for one dataset; `errors` lists pieces that could not be loaded."""

    name: str
    validation: dict[str, Any] | None = None
    billing: dict[str, Any] | None = None
    lengths: dict[str, Any] | None = None
    generation: dict[str, Any] | None = None
    thresholds: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    validation_uri: str | None = None  # where the validation report lies: the verdict block's commands name its stages

    @property
    def gate(self) -> dict[str, Any] | None:
        """The dataset's gate: the run gate (round trip + billing) when written, else the round trip's."""
        v = self.validation or {}
        return v.get("run_gate") or v.get("gate")

    @property
    def calibration(self) -> dict[str, Any] | None:
        """The provider calibration (`stages.validate.consistency.consistency_report`) in the validation report."""
        cal = (self.validation or {}).get("calibration")
        return cal if isinstance(cal, dict) else None

    @property
    def identity(self) -> dict[str, Any] | None:
        """Who answered (`validate.identity_report`): answers per model @ provider and the mismatches."""
        ident = (self.validation or {}).get("identity")
        return ident if isinstance(ident, dict) else None

    @property
    def policy(self) -> dict[str, Any] | None:
        """The policy check (`policy.policy_gate` with its `figures`): overflow vs local log-probabilities."""
        pol = (self.validation or {}).get("policy")
        return pol if isinstance(pol, dict) else None

    def summary(self) -> dict[str, Any]:
        """The numbers of the report, for the JSON endpoint, the renderers and tests."""
        v = self.validation or {}
        counts = {c: int((v.get("counts") or {}).get(c, 0)) for c in classes()}
        samples = int(v.get("samples") or 0)
        return {
            "dataset": self.name,
            "samples": samples,
            "counts": counts,
            "rates": {c: (counts[c] / samples if samples else 0.0) for c in counts},
            "sample_mismatch_rate": v.get("sample_mismatch_rate"),
            "token_agreement": v.get("token_agreement"),
            "bad_rows": bad_row_count(v.get("bad_rows")),
            "gate": self.gate,
            "thresholds": self.thresholds,
            "first_diff_histogram": first_diff_histogram(v.get("mismatches") or []),
            "billing": self.billing,
            "calibration": calibration_summary(self.calibration),
            "identity": identity_summary(self.identity),
            "policy": policy_summary(self.policy),
            "generation": self.generation,
            "lengths": {
                k: {s: d.get(s) for s in ("count", "mean", "p50", "p95", "max")}
                for k, d in (self.lengths or {}).items()
                if isinstance(d, dict)
            },
            "errors": self.errors,
        }


@dataclass
class RunReport:
    """One run's index and the per-dataset reports it names, sorted by dataset name."""

    run_key: str
    index: dict[str, Any]
    datasets: list[DatasetReport]

    def summary(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "created_at": self.index.get("created_at"),
            "datasets": [d.summary() for d in self.datasets],
        }


def load_run_report(store: ArtifactStore, run_key: str) -> RunReport:
    """The run's index and every artifact it names. A missing or unreadable artifact is recorded
    in its dataset's `errors`, not raised, so one dataset's failed validation does not hide the
    others; an unreachable S3 or a missing bucket (`STORAGE_OUTAGES`) is raised: an outage, not a gap."""
    index = store.get_json(run_report_ref(run_key), RUN_REPORT_NAME)
    _check_index(index, store, run_key)
    datasets = []
    for name, entry in sorted(index["datasets"].items()):
        report = DatasetReport(
            name=name,
            thresholds=dict(entry.get("thresholds") or {}),
            lengths=entry.get("lengths"),
            generation=entry.get("generation"),
            validation_uri=entry.get("validation"),
        )
        for kind in ARTIFACT_KINDS:
            if entry.get(kind) is None:
                continue
            ref, file_name = _ref_of(store, entry[kind], f"datasets.{name}.{kind}")
            try:
                obj = store.get_json(ref, file_name)
            except STORAGE_OUTAGES:
                raise
            except (StorageError, ValueError) as exc:
                report.errors.append(f"{kind}: {exc}")
                continue
            if not isinstance(obj, dict):
                report.errors.append(f"{kind}: {entry[kind]} is not a JSON object")
                continue
            setattr(report, kind, obj)
        written = (report.gate or {}).get("thresholds")  # what the gate actually applied
        report.thresholds = {**report.thresholds, **(written if isinstance(written, dict) else {})}
        datasets.append(report)
    return RunReport(run_key=run_key, index=index, datasets=datasets)


# -- statistics ----------------------------------------------------------------------------------
def length_stats(values: Sequence[int], bins: int = 20) -> dict[str, Any]:
    """Summary + histogram of token lengths, the shape `lengths` artifacts hold per field
    (e.g. {"prompt_tokens": length_stats(p), "output_tokens": length_stats(o)})."""
    vals = sorted(int(v) for v in values)
    if not vals:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "max": None, "edges": [], "counts": []}
    lo, hi = vals[0], vals[-1]
    width = max(1, math.ceil((hi - lo + 1) / bins))
    edges = [lo + i * width for i in range(math.ceil((hi - lo + 1) / width) + 1)]
    counts = [0] * (len(edges) - 1)
    for v in vals:
        counts[(v - lo) // width] += 1
    return {
        "count": len(vals),
        "mean": sum(vals) / len(vals),
        "p50": _percentile(vals, 0.50),
        "p95": _percentile(vals, 0.95),
        "max": hi,
        "edges": edges,
        "counts": counts,
    }


def generation_lengths(store: ArtifactStore, refs: Sequence[StageRef]) -> dict[str, Any]:
    """Prompt and output token lengths of the ok rows of generation stages (local + reconstructed
    overflow), as `length_stats`, for a dataset entry's `lengths`."""
    import pyarrow.compute as pc

    prompt, output = [], []
    for ref in refs:
        if not store.is_complete(ref):
            continue
        for batch in store.iter_batches(ref, columns=["status", "prompt_ids", "output_ids"]):
            ok = batch.filter(pc.equal(batch.column("status"), "ok"))
            prompt += pc.list_value_length(ok.column("prompt_ids")).fill_null(0).to_pylist()
            output += pc.list_value_length(ok.column("output_ids")).fill_null(0).to_pylist()
    return {"prompt_tokens": length_stats(prompt), "output_tokens": length_stats(output)}


def _percentile(sorted_vals: Sequence[int], q: float) -> int:
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def first_diff_histogram(mismatches: Sequence[Mapping[str, Any]], bins: int = 16) -> dict[str, list[int]]:
    """Histogram of first-difference positions (token index in the output) over listed mismatches."""
    positions = [int(m["first_diff"]) for m in mismatches if is_number(m.get("first_diff"))]
    if not positions:
        return {"edges": [], "counts": []}
    stats = length_stats(positions, bins=bins)
    return {"edges": stats["edges"], "counts": stats["counts"]}


def rate_thresholds(
    rates: Mapping[str, float], thresholds: Mapping[str, float]
) -> list[tuple[str, float, float | None]]:
    """(class, rate, threshold) for every non-exact class, those with a written threshold first.
    The threshold is `max_<class>_rate` (bpe_only: `max_bpe_mismatch_rate`, None when absent);
    any other class without one fails on any sample, so its threshold is 0.0."""
    out = []
    for c in classes():
        if c == "exact":
            continue
        key = RATE_THRESHOLD_ALIASES.get(c, f"max_{c}_rate")
        threshold = thresholds.get(key, None if c in RATE_THRESHOLD_ALIASES else 0.0)
        out.append((c, rates.get(c, 0.0), threshold, key in thresholds))
    out.sort(key=lambda r: not r[3])
    return [(c, rate, threshold) for c, rate, threshold, _ in out]


def calibration_summary(cal: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The calibration's numbers without its per-sample texts (those are on the page)."""
    if cal is None:
        return None
    keys = ("first_n", "samples", "agreement", "text_agreement", "mean_agreeing_prefix", "text_disagreements")
    return {
        **{k: cal.get(k) for k in keys},
        "missing": bad_row_count(cal.get("missing")),
        "unreconstructable": bad_row_count(cal.get("unreconstructable")),
    }


def identity_summary(ident: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The identity counts without the example ids."""
    if ident is None:
        return None
    return {k: ident.get(k) for k in ("answered", "mismatched", "rate", "served", "reasons")} | {
        "passed": (ident.get("gate") or {}).get("passed")
    }


def policy_summary(policy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The policy check's decision and headline figures: per side (samples, tokens, mean of the
    samples' means), per test (shift, standard error, p-value, minimum detectable shift,
    underpowered), the calibration pairs, the power statement and the sample sizing."""
    if policy is None:
        return None
    figures = policy.get("figures") if isinstance(policy.get("figures"), dict) else {}
    sides = {
        side: {k: (figures.get(side) or {}).get(k) for k in ("samples", "tokens", "mean_logprob")}
        for side in ("local", "overflow")
        if isinstance(figures.get(side), dict)
    }
    decision = policy.get("decision") if isinstance(policy.get("decision"), dict) else {}
    pairs = figures.get("pairs") if isinstance(figures.get("pairs"), dict) else {}
    return {
        "passed": policy.get("passed"),
        "reasons": list(policy.get("reasons") or []),
        "notes": list(policy.get("notes") or []),
        "gap_nats_per_token": figures.get("gap_nats_per_token"),
        "tests": decision.get("tests") or {},
        "thresholds": decision.get("thresholds"),
        "underpowered": decision.get("underpowered"),
        "pairs": {k: pairs.get(k) for k in ("samples", "identical_ids", "mean_difference")} if pairs else None,
        "sizing": figures.get("sizing"),
        **sides,
    }


def decode_least_likely(logprobs: Mapping[str, Any] | None, tokenizer: Callable[[], Any]) -> dict[str, Any] | None:
    """The extraction's log-probability figures (target_head.logprobs.LogprobStats, added up
    over shards) with each least likely sample's kept ids decoded one by one (`tokenizer()` gives
    the run's; loaded only when there is something to decode): the report shows the likeliest
    garbage as text."""
    if not logprobs:
        return None if logprobs is None else dict(logprobs)
    tok = None
    sources = {}
    for source, side in (logprobs.get("sources") or {}).items():
        worst = []
        for w in side.get("least_likely_samples") or []:
            if w.get("ids"):
                tok = tok or tokenizer()
                w = {**w, "texts": [tok.decode([i]) for i in w["ids"]]}
            worst.append(w)
        sources[source] = {**side, "least_likely_samples": worst}
    return {**logprobs, "sources": sources}


def bad_row_count(bad_rows: Any) -> int:
    """A count from either the list of bad rows or a number (older reports wrote the number)."""
    return len(bad_rows) if isinstance(bad_rows, list) else int(bad_rows or 0)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
