"""A run's validation results as one page: the run-report index, its loader and the HTML.

The DAG's publish step writes a small index (`write_run_report`) naming, per dataset, the S3
objects that hold the validation report and the overflow billing check, with token-length and
generation totals inline.
The Airflow plugin (plugins/validation_report.py) maps a DAG run to its run key, loads the index
with `load_run_report` and serves `render_html`. Everything here is plain Python so the page can
be tested, and rendered from the CLI, without Airflow.

The page shows model outputs, which are untrusted text: every string goes through `html.escape`,
and charts are inline SVG built here (no scripts, no external assets: the cluster may have no
network and the page must not phone home).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from html import escape
from typing import Any, Mapping, Sequence

from eagle3_data.errors import UserError
from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_data.storage.refs import StorageError, check_name

RUN_REPORT_STAGE = "report"
RUN_REPORT_DATASET = "run"
RUN_REPORT_NAME = "run_report.json"
RUN_REPORT_FORMAT = "eagle3-run-report/1"
CLASSES = ("exact", "bpe_only", "special_token", "text_diff")
ARTIFACT_KINDS = ("validation", "billing")  # stage reports a dataset entry points to (s3:// URIs)
INLINE_KINDS = ("lengths", "generation")  # small summaries a dataset entry holds inline
CLASS_COLORS = {"exact": "#2e7d32", "bpe_only": "#f9a825", "special_token": "#6a1b9a", "text_diff": "#c62828"}
MAX_EXAMPLES = 20  # mismatch examples shown per dataset
MAX_CALIBRATION_ROWS = 10  # differing calibration samples shown per dataset
_BAD = " class='bad'"  # a highlighted table row


# -- run key and index ---------------------------------------------------------------------------
def run_key_for(dag_run_conf: Mapping[str, Any] | None, logical_date: datetime | None) -> str:
    """The run key of a DAG run: the conf's `run_name`, else `date=YYYY-MM-DD` of the logical date (UTC).

    The DAG and the report view both call this, so the page always finds the run's artifacts.
    """
    run_name = (dag_run_conf or {}).get("run_name")
    if run_name:
        return check_name(run_name, "run_name")
    if logical_date is None:
        raise UserError("dag run: no conf.run_name and no logical_date; a manual run needs a run_name")
    if logical_date.tzinfo is not None:
        logical_date = logical_date.astimezone(timezone.utc)
    return f"date={logical_date:%Y-%m-%d}"


def run_report_ref(run_key: str) -> StageRef:
    """Where the index lives: `runs/{run_key}/report/run/run_report.json`."""
    return StageRef(run_key, RUN_REPORT_STAGE, RUN_REPORT_DATASET)


def write_run_report(
    store: ArtifactStore,
    run_key: str,
    datasets: Mapping[str, Mapping[str, Any]],
    *,
    dag_id: str | None = None,
    run_id: str | None = None,
) -> str:
    """Write and commit the index. `datasets` maps name -> {validation: uri, billing?: uri,
    thresholds?: {name: number}, lengths?: `generation_lengths(...)`, generation?: {local: totals,
    overflow: totals}} (totals: ok, failed, prompt_tokens, completion_tokens, cost_usd).
    Returns the index URI."""
    index = {
        "format": RUN_REPORT_FORMAT,
        "run_key": run_key,
        "dag_id": dag_id,
        "run_id": run_id,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "datasets": {name: dict(entry) for name, entry in datasets.items()},
    }
    _check_index(index, store, run_key)
    ref = run_report_ref(run_key)
    uri = store.put_json(ref, RUN_REPORT_NAME, index)
    store.commit_files(ref, [RUN_REPORT_NAME], params={"datasets": sorted(datasets)})
    return uri


def _check_index(index: Any, store: ArtifactStore, run_key: str) -> None:
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
        if not isinstance(thresholds, dict) or not all(_is_number(v) for v in thresholds.values()):
            raise UserError(f"{where}: datasets.{name}.thresholds must map names to numbers")


def _ref_of(store: ArtifactStore, uri: str, field_name: str) -> tuple[StageRef, str]:
    """The (StageRef, file name) of an artifact URI, refusing anything outside this store's runs/."""
    base = f"s3://{store.bucket}/{store.prefix + '/' if store.prefix else ''}runs/"
    match = re.fullmatch(re.escape(base) + r"([^/]+)/([^/]+)/([^/]+)/([^/]+)", uri or "")
    if not match:
        raise UserError(f"{field_name}: {uri!r} is not an artifact of {base}{{run_key}}/{{stage}}/{{dataset}}/{{name}}")
    return StageRef(match[1], match[2], match[3]), match[4]


# -- loading -------------------------------------------------------------------------------------
@dataclass
class DatasetReport:
    """What the page shows for one dataset; `errors` lists pieces that could not be loaded."""

    name: str
    validation: dict[str, Any] | None = None
    billing: dict[str, Any] | None = None
    lengths: dict[str, Any] | None = None
    generation: dict[str, Any] | None = None
    thresholds: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def gate(self) -> dict[str, Any] | None:
        """The dataset's gate: the run gate (round trip + billing) when written, else the round trip's."""
        v = self.validation or {}
        return v.get("run_gate") or v.get("gate")

    @property
    def calibration(self) -> dict[str, Any] | None:
        """The provider calibration (`generation.routing.consistency_report`) in the validation report."""
        cal = (self.validation or {}).get("calibration")
        return cal if isinstance(cal, dict) else None

    def summary(self) -> dict[str, Any]:
        """The numbers of the page, for the JSON endpoint and tests."""
        v = self.validation or {}
        counts = {c: int((v.get("counts") or {}).get(c, 0)) for c in CLASSES}
        samples = int(v.get("samples") or 0)
        return {
            "dataset": self.name,
            "samples": samples,
            "counts": counts,
            "rates": {c: (counts[c] / samples if samples else 0.0) for c in CLASSES},
            "sample_mismatch_rate": v.get("sample_mismatch_rate"),
            "token_agreement": v.get("token_agreement"),
            "bad_rows": _bad_row_count(v.get("bad_rows")),
            "gate": self.gate,
            "thresholds": self.thresholds,
            "first_diff_histogram": first_diff_histogram(v.get("mismatches") or []),
            "billing": self.billing,
            "calibration": _calibration_summary(self.calibration),
            "generation": self.generation,
            "lengths": {k: {s: d.get(s) for s in ("count", "mean", "p50", "p95", "max")} for k, d in (self.lengths or {}).items() if isinstance(d, dict)},
            "errors": self.errors,
        }


@dataclass
class RunReport:
    run_key: str
    index: dict[str, Any]
    datasets: list[DatasetReport]

    def summary(self) -> dict[str, Any]:
        return {"run_key": self.run_key, "created_at": self.index.get("created_at"), "datasets": [d.summary() for d in self.datasets]}


def load_run_report(store: ArtifactStore, run_key: str) -> RunReport:
    """The run's index and every artifact it names; a missing artifact is recorded, not raised,
    so one dataset's failed validation does not hide the others."""
    index = store.get_json(run_report_ref(run_key), RUN_REPORT_NAME)
    _check_index(index, store, run_key)
    datasets = []
    for name, entry in sorted(index["datasets"].items()):
        report = DatasetReport(
            name=name, thresholds=dict(entry.get("thresholds") or {}),
            lengths=entry.get("lengths"), generation=entry.get("generation"),
        )
        for kind in ARTIFACT_KINDS:
            if entry.get(kind) is None:
                continue
            ref, file_name = _ref_of(store, entry[kind], f"datasets.{name}.{kind}")
            try:
                obj = store.get_json(ref, file_name)
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


# -- statistics producers call ------------------------------------------------------------------
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
    positions = [int(m["first_diff"]) for m in mismatches if _is_number(m.get("first_diff"))]
    if not positions:
        return {"edges": [], "counts": []}
    stats = length_stats(positions, bins=bins)
    return {"edges": stats["edges"], "counts": stats["counts"]}


def _calibration_summary(cal: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The calibration's numbers without its per-sample texts (those are on the page)."""
    if cal is None:
        return None
    keys = ("first_n", "samples", "agreement", "text_agreement", "mean_agreeing_prefix", "text_disagreements")
    return {**{k: cal.get(k) for k in keys}, "missing": _bad_row_count(cal.get("missing")),
            "unreconstructable": _bad_row_count(cal.get("unreconstructable"))}


def _bad_row_count(bad_rows: Any) -> int:
    return len(bad_rows) if isinstance(bad_rows, list) else int(bad_rows or 0)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- HTML ----------------------------------------------------------------------------------------
def render_html(report: RunReport, *, title: str) -> str:
    """The whole page as one self-contained HTML document."""
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p class='meta'>run key <code>{escape(report.run_key)}</code> &middot; index written "
        f"{escape(str(report.index.get('created_at') or '?'))}</p>",
        _overview(report),
    ]
    parts += [_dataset_section(d) for d in report.datasets]
    parts.append("</body></html>")
    return "".join(parts)


def render_missing(run_key: str, reason: str, *, title: str) -> str:
    """The page for a run whose report is not there (yet): says where it was looked for."""
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{escape(title)}</h1>"
        f"<p class='error'>No validation report for run key <code>{escape(run_key)}</code>: {escape(reason)}</p>"
        "<p>The report index is written by the DAG's publish step; a run that has not reached it, "
        "or failed before validation, has none.</p></body></html>"
    )


def _overview(report: RunReport) -> str:
    rows = []
    for d in report.datasets:
        s = d.summary()
        gate = s["gate"] or {}
        status = "passed" if gate.get("passed") else ("failed" if gate else "no report")
        rows.append(
            "<tr>"
            f"<td><a href='#ds-{escape(d.name)}'>{escape(d.name)}</a></td>"
            f"<td class='num'>{s['samples']:,}</td>"
            + "".join(f"<td class='num'>{s['counts'][c]:,}</td>" for c in CLASSES)
            + f"<td class='num'>{_pct(s['sample_mismatch_rate'])}</td>"
            f"<td class='num'>{_pct(s['token_agreement'])}</td>"
            f"<td class='num'>{s['bad_rows']:,}</td>"
            f"<td><span class='gate {status.replace(' ', '-')}'>{status}</span></td></tr>"
        )
    head = "".join(f"<th>{escape(c)}</th>" for c in CLASSES)
    return (
        "<table class='overview'><thead><tr><th>dataset</th><th>samples</th>"
        f"{head}<th>mismatch rate</th><th>token agreement</th><th>bad rows</th><th>gate</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _dataset_section(d: DatasetReport) -> str:
    s = d.summary()
    out = [f"<section id='ds-{escape(d.name)}'><h2>{escape(d.name)}</h2>"]
    out += [f"<p class='error'>{escape(e)}</p>" for e in d.errors]
    gate = d.gate or {}
    if gate:
        cls = "passed" if gate.get("passed") else "failed"
        reasons = "".join(f"<li>{escape(str(r))}</li>" for r in gate.get("reasons") or [])
        out.append(f"<div class='gatebox {cls}'>gate <b>{cls}</b>{f'<ul>{reasons}</ul>' if reasons else ''}</div>")
    if d.validation is not None:
        out.append("<div class='charts'>")
        out.append(_figure("Samples per class", _class_bars(s["counts"], s["samples"])))
        out.append(_figure("Mismatch rates against thresholds", _threshold_bars(s)))
        hist = s["first_diff_histogram"]
        out.append(_figure(
            "First-difference position (output token index) of listed mismatches",
            _histogram(hist["edges"], hist["counts"], "#c62828") if hist["counts"] else "<p class='muted'>no mismatches</p>",
        ))
        out.append("</div>")
    out.append(_lengths_block(d.lengths))
    out.append(_generation_block(d.generation))
    out.append(_billing_block(d.billing, d.thresholds.get("max_billing_deviation")))
    out.append(_calibration_block(d.calibration))
    if d.validation is not None:
        out.append(_examples_block(d.validation.get("mismatches") or []))
    out.append("</section>")
    return "".join(out)


def _figure(caption: str, body: str) -> str:
    return f"<figure><figcaption>{escape(caption)}</figcaption>{body}</figure>"


def _class_bars(counts: Mapping[str, int], samples: int) -> str:
    width, bar_h, gap, label_w = 420, 26, 10, 110
    top = max(1, max(counts.values(), default=0))
    rows = []
    for i, c in enumerate(CLASSES):
        y = i * (bar_h + gap)
        w = (width - label_w - 90) * counts[c] / top
        share = f" ({counts[c] / samples:.1%})" if samples else ""
        rows.append(
            f"<text x='{label_w - 8}' y='{y + 18}' text-anchor='end'>{c}</text>"
            f"<rect x='{label_w}' y='{y}' width='{w:.1f}' height='{bar_h}' fill='{CLASS_COLORS[c]}'/>"
            f"<text x='{label_w + w + 6:.1f}' y='{y + 18}'>{counts[c]:,}{share}</text>"
        )
    height = len(CLASSES) * (bar_h + gap)
    return _svg(width, height, "".join(rows))


def _threshold_bars(s: Mapping[str, Any]) -> str:
    """Each class rate with a marker at its threshold: a bar past its marker is what failed."""
    thresholds = s["thresholds"]
    rates = [  # validate.py fails any special_token sample; text_diff defaults to the same
        ("bpe_only", s["rates"]["bpe_only"], thresholds.get("max_bpe_mismatch_rate")),
        ("text_diff", s["rates"]["text_diff"], thresholds.get("max_text_diff_rate", 0.0)),
        ("special_token", s["rates"]["special_token"], 0.0),
    ]
    width, bar_h, gap, label_w = 420, 26, 22, 110
    scale_max = max([0.01] + [r for _, r, _ in rates] + [t for _, _, t in rates if t is not None]) * 1.15
    inner = width - label_w - 20
    rows = []
    for i, (c, rate, threshold) in enumerate(rates):
        y = i * (bar_h + gap) + 4
        over = threshold is not None and rate > threshold
        rows.append(
            f"<text x='{label_w - 8}' y='{y + 18}' text-anchor='end'>{c}</text>"
            f"<rect x='{label_w}' y='{y}' width='{inner}' height='{bar_h}' fill='#eceff1'/>"
            f"<rect x='{label_w}' y='{y}' width='{inner * rate / scale_max:.1f}' height='{bar_h}' "
            f"fill='{'#c62828' if over else '#2e7d32'}'/>"
            f"<text x='{label_w + 6}' y='{y + 18}' class='onbar'>{rate:.2%}</text>"
        )
        if threshold is not None:
            x = label_w + inner * threshold / scale_max
            rows.append(
                f"<line x1='{x:.1f}' y1='{y - 4}' x2='{x:.1f}' y2='{y + bar_h + 4}' stroke='#000' stroke-width='2'/>"
                f"<text x='{min(x + 4, width - 90):.1f}' y='{y + bar_h + 15}' class='small'>max {threshold:.2%}</text>"
            )
    return _svg(width, len(rates) * (bar_h + gap) + 6, "".join(rows))


def _histogram(edges: Sequence[float], counts: Sequence[int], color: str) -> str:
    width, height, left, bottom = 420, 170, 40, 34
    top = max(1, max(counts, default=0))
    inner_w, inner_h = width - left - 10, height - bottom - 14
    bw = inner_w / max(1, len(counts))
    bars = []
    for i, n in enumerate(counts):
        h = inner_h * n / top
        bars.append(
            f"<rect x='{left + i * bw + 1:.1f}' y='{14 + inner_h - h:.1f}' width='{max(1.0, bw - 2):.1f}' "
            f"height='{h:.1f}' fill='{color}'><title>[{edges[i]:g}, {edges[i + 1]:g}): {n}</title></rect>"
        )
    axis = (
        f"<line x1='{left}' y1='{14 + inner_h}' x2='{width - 10}' y2='{14 + inner_h}' stroke='#555'/>"
        f"<text x='{left - 4}' y='20' text-anchor='end' class='small'>{top:,}</text>"
        f"<text x='{left - 4}' y='{14 + inner_h}' text-anchor='end' class='small'>0</text>"
        f"<text x='{left}' y='{height - 12}' class='small'>{edges[0]:,g}</text>"
        f"<text x='{left + inner_w / 2:.0f}' y='{height - 12}' text-anchor='middle' class='small'>{edges[len(edges) // 2]:,g}</text>"
        f"<text x='{width - 10}' y='{height - 12}' text-anchor='end' class='small'>{edges[-1]:,g}</text>"
    )
    return _svg(width, height, "".join(bars) + axis)


def _svg(width: int, height: int, body: str) -> str:
    return f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>{body}</svg>"


def _lengths_block(lengths: Mapping[str, Any] | None) -> str:
    if not lengths:
        return ""
    figs = []
    for key, st in sorted(lengths.items()):
        if not isinstance(st, dict) or not st.get("counts"):
            continue
        caption = (
            f"{key}: n={st.get('count', 0):,}, mean {_num(st.get('mean'))}, p50 {_num(st.get('p50'))}, "
            f"p95 {_num(st.get('p95'))}, max {_num(st.get('max'))}"
        )
        figs.append(_figure(caption, _histogram(st["edges"], st["counts"], "#1565c0")))
    return f"<h3>Token lengths</h3><div class='charts'>{''.join(figs)}</div>" if figs else ""


def _generation_block(generation: Mapping[str, Any] | None) -> str:
    if not generation:
        return ""
    cols = ("ok", "failed", "prompt_tokens", "completion_tokens", "cost_usd")
    rows = []
    for path in ("local", "overflow"):
        t = generation.get(path)
        if isinstance(t, dict):
            cells = "".join(
                f"<td class='num'>{_usd(t.get(c)) if c == 'cost_usd' else _num(t.get(c))}</td>" for c in cols
            )
            rows.append(f"<tr><th>{path}</th>{cells}</tr>")
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in cols)
    return f"<h3>Generation</h3><table class='grid'><tr><th></th>{head}</tr>{''.join(rows)}</table>" if rows else ""


def _billing_block(billing: Mapping[str, Any] | None, max_dev: float | None) -> str:
    """Billed (provider's own tokenizer) vs reconstructed completion tokens of the overflow rows."""
    excluded = billing.get("excluded") if isinstance((billing or {}).get("excluded"), dict) else {}
    if not billing or not (billing.get("rows") or excluded.get("rows")):
        return ""
    if max_dev is None:
        max_dev = (billing.get("gate") or {}).get("max_aggregate_deviation")
    dev = billing.get("deviation")
    over = _is_number(dev) and _is_number(max_dev) and abs(dev) > max_dev
    rows = [
        ("overflow rows", _num(billing.get("rows"))),
        ("completion tokens billed", _num(billing.get("billed_completion_tokens"))),
        ("completion tokens reconstructed", _num(billing.get("reconstructed_completion_tokens"))),
        ("aggregate deviation", _pct(dev, 3) + (f" (max ±{max_dev:.2%})" if _is_number(max_dev) else "")),
        ("mean |sample deviation|", _pct(billing.get("mean_abs_sample_deviation"), 3)),
    ]
    if excluded.get("rows"):  # unreconstructable rows: their gap says nothing about reconstruction
        rows.append(("excluded, unreconstructable", f"{_num(excluded['rows'])} rows, "
                     f"{_num(excluded.get('billed_completion_tokens'))} tokens billed"))
        reasons = excluded.get("reasons") if isinstance(excluded.get("reasons"), dict) else {}
        rows += [(f"reason: {why}", _num(n)) for why, n in sorted(reasons.items())]
    body = "".join(f"<tr><th>{escape(str(k))}</th><td class='num'>{escape(v)}</td></tr>" for k, v in rows)
    worst = [w for w in billing.get("worst_samples") or [] if isinstance(w, dict)][:5]
    worst_rows = "".join(
        f"<tr><td><code>{escape(str(w.get('sample_id')))}</code></td><td class='num'>{_num(w.get('billed'))}</td>"
        f"<td class='num'>{_num(w.get('reconstructed'))}</td><td class='num'>{_pct(w.get('deviation'))}</td></tr>"
        for w in worst
    )
    worst_table = (
        "<table class='grid'><tr><th>worst samples</th><th>billed</th><th>reconstructed</th><th>deviation</th></tr>"
        f"{worst_rows}</table>" if worst_rows else ""
    )
    notes = "".join(f"<li>{escape(str(n))}</li>" for n in (billing.get("gate") or {}).get("notes") or [])
    return (
        f"<h3>Overflow billing check</h3><div class='charts'><table class='kv{' over' if over else ''}'>{body}</table>"
        f"{worst_table}</div>" + (f"<ul class='notes'>{notes}</ul>" if notes else "")
    )


def _calibration_block(cal: Mapping[str, Any] | None) -> str:
    """Samples generated on both paths: engine ids vs the provider's reconstructed text. Informational,
    not a gate; a text disagreement points at a different model, template or reasoning setting."""
    if cal is None:
        return ""
    s = _calibration_summary(cal)
    n = s["first_n"]
    disagree = s["text_disagreements"] if isinstance(s["text_disagreements"], list) else []
    rows = [
        ("samples compared", _num(s["samples"])),
        (f"token agreement, first {_num(n)} ids", _pct(s["agreement"])),
        ("text agreement", _pct(s["text_agreement"])),
        ("mean agreeing prefix (ids)", _num(s["mean_agreeing_prefix"])),
        ("text disagreements", _num(len(disagree))),
        ("missing on a path", _num(s["missing"])),
        ("unreconstructable", _num(s["unreconstructable"])),
    ]
    body = "".join(
        f"<tr{_BAD if k == 'text disagreements' and disagree else ''}><th>{escape(k)}</th>"
        f"<td class='num'>{escape(v)}</td></tr>" for k, v in rows
    )
    differing = [p for p in cal.get("per_sample") or []
                 if isinstance(p, dict) and (p.get("first_diff") is not None or not p.get("same_text", True))]
    differing.sort(key=lambda p: bool(p.get("same_text")))  # text disagreements first
    shown = differing[:MAX_CALIBRATION_ROWS]
    sample_rows = "".join(
        f"<tr{'' if p.get('same_text') else _BAD}><td><code>{escape(str(p.get('sample_id')))}</code></td>"
        f"<td class='num'>{_num(p.get('first_diff'))}</td><td class='num'>{_num(p.get('agreeing_prefix'))}</td>"
        f"<td>{'same text (BPE split)' if p.get('same_text') else '<b>text differs</b>'}</td>"
        f"<td class='text'>{escape(str(p.get('engine_text', '')))}</td>"
        f"<td class='text'>{escape(str(p.get('provider_text', '')))}</td></tr>"
        for p in shown
    )
    more = f"<p class='muted'>{len(differing) - len(shown)} more differing samples not shown</p>" if len(differing) > len(shown) else ""
    samples_table = (
        "<table class='grid'><tr><th>differing sample</th><th>first diff</th><th>agreeing prefix</th><th></th>"
        f"<th>engine text</th><th>provider text</th></tr>{sample_rows}</table>{more}" if sample_rows else ""
    )
    proof = "".join(
        f"<p class='muted'><b>{label}:</b> {escape(str(cal[key]))}</p>"
        for key, label in (("can_prove", "Can prove"), ("cannot_prove", "Cannot prove")) if cal.get(key)
    )
    warning = (
        f"<p class='error'>The provider's text differs from the engine's in {len(disagree)} sample(s): it may serve a "
        "different model, chat template, system prompt or reasoning setting.</p>" if disagree else ""
    )
    return (
        f"<h3>Provider calibration</h3><div class='charts'><table class='kv cal'>{body}</table></div>"
        f"{warning}{samples_table}{proof}"
    )


def _examples_block(mismatches: Sequence[Mapping[str, Any]]) -> str:
    if not mismatches:
        return ""
    severity = {c: i for i, c in enumerate(reversed(CLASSES))}  # text_diff first, bpe_only last
    shown = sorted(mismatches, key=lambda m: severity.get(str(m.get("class")), len(CLASSES)))[:MAX_EXAMPLES]
    items = []
    for m in shown:
        cls = str(m.get("class", "?"))
        fd = m.get("first_diff")
        items.append(
            f"<div class='example'><div class='exhead'><span class='cls' style='background:{CLASS_COLORS.get(cls, '#555')}'>"
            f"{escape(cls)}</span> <code>{escape(str(m.get('sample_id', '?')))}</code> first difference at token "
            f"<b>{escape(str(fd))}</b></div>"
            f"<div class='diffrow'><span class='side'>original</span>{_tokens(m.get('original'))}</div>"
            f"<div class='diffrow'><span class='side'>reconstructed</span>{_tokens(m.get('reconstructed'))}</div></div>"
        )
    more = f"<p class='muted'>{len(mismatches) - len(shown)} more not shown</p>" if len(mismatches) > len(shown) else ""
    return f"<details open><summary><h3>Example diffs ({len(shown)} of {len(mismatches)})</h3></summary>{''.join(items)}{more}</details>"


def _tokens(seq: Any) -> str:
    """The differing span (validate.py stores up to 8 tokens from the first difference), one box
    per token so whitespace and BPE splits are visible."""
    if not isinstance(seq, list):
        return "<span class='muted'>—</span>"
    if not seq:
        return "<span class='muted'>(ends here)</span>"
    return "".join(
        f"<span class='tok'>{escape(str(t)).replace(' ', '·').replace(chr(10), '↵')}</span>" for t in seq
    )


def _pct(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}%}" if _is_number(v) else "—"


def _usd(v: Any) -> str:
    return f"${v:,.4f}" if _is_number(v) else "—"


def _num(v: Any) -> str:
    if not _is_number(v):
        return "—"
    return f"{v:,.1f}" if isinstance(v, float) and not v.is_integer() else f"{int(v):,}"


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,'Noto Sans','Noto Sans CJK SC',sans-serif;
 margin:16px 24px;color:#1f2328;background:#fff;font-size:14px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:18px;border-bottom:2px solid #d0d7de;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:16px 0 6px}.meta,.muted{color:#656d76}.error{color:#b71c1c;font-weight:600}
table{border-collapse:collapse}th,td{padding:4px 10px;border-bottom:1px solid #e5e7eb;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.overview th{background:#f6f8fa}.gate{padding:2px 8px;border-radius:10px;color:#fff;font-weight:600}
.gate.passed{background:#2e7d32}.gate.failed{background:#c62828}.gate.no-report{background:#757575}
.gatebox{padding:6px 10px;border-radius:6px;margin:6px 0;display:inline-block}
.gatebox.passed{background:#e8f5e9}.gatebox.failed{background:#ffebee}.gatebox ul{margin:4px 0 0 0}
.charts{display:flex;flex-wrap:wrap;gap:18px}figure{margin:0;border:1px solid #e5e7eb;border-radius:6px;padding:8px}
figcaption{font-weight:600;margin-bottom:6px;max-width:420px}
svg text{font-size:12px;fill:#1f2328}svg text.small{font-size:11px;fill:#555}svg text.onbar{fill:#000;font-weight:600}
table.kv th,table.grid th{font-weight:normal;color:#444}table.kv.over td{color:#b71c1c;font-weight:600}
.example{border:1px solid #e5e7eb;border-radius:6px;padding:6px 8px;margin:6px 0}
.cls{color:#fff;padding:1px 6px;border-radius:4px;font-size:12px}
.diffrow{margin:4px 0;line-height:1.9;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.side{display:inline-block;width:110px;color:#656d76;font-family:system-ui,sans-serif}
.tok{border:1px solid #cfd8dc;border-radius:3px;padding:0 3px;margin-right:2px;white-space:pre}
.tok{background:#fff8e1}summary h3{display:inline}
tr.bad td,tr.bad th{background:#ffebee;color:#b71c1c}td.text{white-space:pre-wrap;max-width:360px;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
ul.notes{margin:4px 0;color:#656d76}
"""
