"""The run report as HTML (the Airflow tab and `eagle3-data report`) and as Markdown (beside
`eagle3-data validate`'s JSON, and `eagle3-data report --format markdown`), both from the same
`RunReport` data.

Markup lives in jinja2 templates (templates/, package data). HTML templates autoescape: the
report shows model outputs and provider texts, which are untrusted, so no string reaches the page
unescaped. Charts are inline SVG whose geometry is computed here and drawn by templates/charts
(no scripts, no external assets: the cluster may have no network and the page must not phone home).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import jinja2

from eagle3_data.report.data import (
    DatasetReport,
    RunReport,
    calibration_summary,
    classes,
    is_number,
    rate_thresholds,
)

MAX_EXAMPLES = 20  # mismatch examples shown per dataset
MAX_CALIBRATION_ROWS = 10  # differing calibration samples shown per dataset
MAX_MARKDOWN_ROWS = 50  # mismatches and bad rows listed per dataset in Markdown
KNOWN_CLASS_COLORS = {"exact": "#2e7d32", "bpe_only": "#f9a825", "special_token": "#6a1b9a", "text_diff": "#c62828"}
_SPARE_COLORS = ("#00838f", "#ef6c00", "#4e342e", "#283593", "#ad1457")  # for classes the gate adds later


# -- entry points --------------------------------------------------------------------------------
def render_html(report: RunReport, *, title: str) -> str:
    """The whole page as one self-contained HTML document."""
    training = report.index.get("training") or {}
    return (
        _env()
        .get_template("page.html.jinja")
        .render(
            title=title,
            report=report,
            classes=classes(),
            datasets=[_dataset_view(d) for d in report.datasets],
            verdict=verdict_lines(report),
            every_row=every_row_histograms(training.get("logprobs")),
        )
    )


def render_missing(run_key: str, reason: str, *, title: str) -> str:
    """The page for a run whose report is not there (yet): says where it was looked for."""
    return _env().get_template("missing.html.jinja").render(title=title, run_key=run_key, reason=reason)


def render_unavailable(run_key: str, reason: str, *, title: str) -> str:
    """The page for a run whose report could not be read because S3 did not answer: unlike
    `render_missing` it does not claim the report is absent."""
    return _env().get_template("unavailable.html.jinja").render(title=title, run_key=run_key, reason=reason)


def render_markdown(
    report: RunReport | DatasetReport | Mapping[str, Any], *, title: str = "Reconstruction validation"
) -> str:
    """The validation report as Markdown, for the people deciding whether to train on the data.
    `report` is a run's report, one dataset's, or a bare validation report (validate.py's dict)."""
    if isinstance(report, RunReport):
        datasets, run = report.datasets, report
    elif isinstance(report, DatasetReport):
        datasets, run = [report], None
    else:
        datasets, run = [DatasetReport(name="", validation=dict(report))], None
    return (
        _env()
        .get_template("report.md.jinja")
        .render(
            title=title,
            run=run,
            classes=classes(),
            datasets=[_dataset_view(d) for d in datasets],
            verdict=verdict_lines(run or RunReport("", {}, list(datasets))),
            max_rows=MAX_MARKDOWN_ROWS,
        )
    )


# -- the verdict block ---------------------------------------------------------------------------
# What each check's failure is fixed or rerun with: the stages it and the stages built on it
# occupy (reuse.settle refuses to replace a stage while one built on it is not named too), so the
# DAG param and the CLI's `--fresh` flags name them all. The command is the stage command that
# has a `--fresh` flag (cli.runs.add_fresh_arg); the probe has none, so only the DAG param.
_RERUN_FROM = {
    "gate": ("validate", "eagle3-data validate --input {reconstruct}"),
    "policy": ("score_policy", "eagle3-data score-policy --input {reconstruct}"),
    "extraction": ("hidden_states", "eagle3-data extract --input {merge}"),
    "export": ("hidden_states", "eagle3-data extract --input {merge}"),
    "probe": ("probe", None),
}
VERDICT_STATES = ("pass", "fail", "neutral")
# config.StandIn's roles as a person reads them at the top of the page
STAND_IN_WORDS = {
    "tokenizer": "dev tokenizer",
    "model": "dev model (a tiny random target)",
    "local_engine": "dev inference server as the local engine",
    "overflow_provider": "dev inference server as the overflow provider",
}


def verdict_lines(report: RunReport) -> dict[str, Any]:
    """The page's first block: one line per dataset per check, each pass, fail or neutral (not
    run, skipped, not compared: the line says why), the stand-ins the run used, and for a failed
    check the next step (the DAG param or command that reruns it). Per dataset: the gate (the
    bulk mismatch validation with billing and identity: validate's run gate) and the policy
    check; for the run's extracted data as a whole: the extraction's self-check, the export check
    (only where the probe made one) and the probe."""
    training = report.index.get("training") or {}
    lines = []
    for d in report.datasets:
        where = _stage_uris(d)
        lines.append(_gate_line(d, where))
        lines.append(_policy_line(d, where))
        for ln in lines[-2:]:
            ln["dataset"] = ln["dataset"] or "this dataset"  # a bare validation report has no name
    run_where = _stage_uris(report.datasets[0]) if report.datasets else {}
    by_check = {}
    for v in training.get("verdicts") or []:
        check = str(v.get("check", ""))
        kind = "extraction" if check.startswith("extraction") else "export" if check.startswith("export") else check
        by_check[kind] = v
    every_row = training.get("policy_every_row")
    if isinstance(every_row, dict):
        lines.append(
            _line(
                "all (run)",
                "policy on every row",
                "pass" if every_row.get("passed") else "fail",
                " ".join(every_row.get("reasons") or [])
                or "the extraction's log-probabilities, local against overflow",
                "policy",
                run_where,
            )
        )
    for kind, label in (("extraction", "extraction self-check"), ("export", "export check"), ("probe", "probe")):
        v = by_check.get(kind)
        if v is None:
            if kind == "probe" and training.get("probe_not_run"):
                lines.append(_line("all (run)", label, "neutral", str(training["probe_not_run"]), kind, run_where))
            elif kind != "export" and report.datasets and not training.get("logprobs"):
                why = "not run: no hidden states were committed in this run (skipped, or their tasks did not finish)"
                lines.append(_line("all (run)", label, "neutral", why, kind, run_where))
            continue  # the export check: only where the probe made one
        verdict = str(v.get("verdict"))
        state = verdict if verdict in ("pass", "fail") else "neutral"
        word = verdict if state == "neutral" else None
        lines.append(_line("all (run)", label, state, str(v.get("rule") or ""), kind, run_where, word))
    stand_ins = [STAND_IN_WORDS.get(str(s), str(s)) for s in report.index.get("stand_ins") or []]
    return {
        "lines": lines,
        "stand_ins": stand_ins,
        "failed": sum(1 for ln in lines if ln["state"] == "fail"),
    }


def _line(
    dataset: str, check: str, state: str, detail: str, kind: str, where: Mapping[str, str], word: str | None = None
) -> dict[str, Any]:
    return {
        "dataset": dataset,
        "check": check,
        "state": state,
        "word": word or {"pass": "pass", "fail": "FAIL", "neutral": "not run"}[state],
        "detail": detail,
        "next": _next_step(kind, where) if state == "fail" else None,
    }


def _next_step(kind: str, where: Mapping[str, str]) -> str:
    from eagle3_data.stages import FRESH_STAGES

    stage, command = _RERUN_FROM[kind]
    stages = list(FRESH_STAGES[FRESH_STAGES.index(stage) :])
    dag = f"rerun the DAG with param fresh_stages {json.dumps(stages)}"
    if command is None:
        return f"fix what the line names, then {dag}"
    cli = command.format(**{k: where.get(k, f"s3://BUCKET/runs/RUN_KEY/{k}/DATASET") for k in ("reconstruct", "merge")})
    return f"fix what the line names, then {dag}, or `{cli} " + " ".join(f"--fresh {s}" for s in stages) + "`"


def _stage_uris(d: DatasetReport) -> dict[str, str]:
    """The dataset's reconstruct stage and the run's merge stage, from its validation report's
    URI (`.../runs/{run_key}/validate/{dataset}/report.json`), for the commands the block names."""
    uri = d.validation_uri or ""
    parts = uri.rsplit("/", 3)
    if len(parts) != 4 or parts[1] != "validate":
        return {}
    return {"reconstruct": f"{parts[0]}/reconstruct/{parts[2]}", "merge": f"{parts[0]}/merge/all"}


def _gate_line(d: DatasetReport, where: Mapping[str, str]) -> dict[str, Any]:
    gate = d.gate
    if not gate:
        why = "; ".join(d.errors) or "no validation report for this dataset"
        return _line(d.name, "gate (bulk mismatch validation)", "neutral", why, "gate", where)
    s = d.summary()
    counted = samples_sentence(s)
    reasons = "; ".join(str(r) for r in gate.get("reasons") or [])
    detail = f"{counted}." + (f" Failed: {reasons}" if reasons else "")
    return _line(
        d.name, "gate (bulk mismatch validation)", "pass" if gate.get("passed") else "fail", detail, "gate", where
    )


# the policy gate's notes for a check that did not run (policy.compare.policy_gate)
_POLICY_NOT_RUN = ("policy not scored", "policy not checked", "policy: no overflow answers")


def _policy_line(d: DatasetReport, where: Mapping[str, str]) -> dict[str, Any]:
    pol = d.policy
    check = "policy check"
    if pol is None:
        why = "no policy check in the validation report" if d.validation is not None else "no validation report"
        return _line(d.name, check, "neutral", why, "policy", where)
    not_run = [str(n) for n in pol.get("notes") or [] if str(n).startswith(_POLICY_NOT_RUN)]
    if pol.get("passed") and not_run:
        return _line(d.name, check, "neutral", "; ".join(not_run), "policy", where, "skipped")
    if pol.get("passed") is False:
        return _line(d.name, check, "fail", "; ".join(str(r) for r in pol.get("reasons") or []), "policy", where)
    decision = pol.get("decision") if isinstance(pol.get("decision"), dict) else {}
    tests = ", ".join(sorted(decision.get("tests") or {})) or "no test"
    short = " (underpowered: see the policy statement below)" if decision.get("underpowered") else ""
    return _line(d.name, check, "pass", f"no test rejected ({tests}){short}", "policy", where)


def samples_sentence(s: Mapping[str, Any]) -> str:
    """What the gate's sample count counts: the local engine's answers the round trip validated
    (overflow answers are checked by billing, not round-tripped), beside how many the local path
    generated, how many failed there and how many rows were skipped as bad."""
    gen = (s.get("generation") or {}).get("local") if isinstance(s.get("generation"), dict) else None
    text = f"{s['samples']:,} local answers round-tripped (decode, parse, reconstruct, compare ids)"
    extra = []
    if isinstance(gen, dict) and is_number(gen.get("ok")):
        extra.append(f"of {fmt_num(gen['ok'])} the local engine answered")
        if gen.get("failed"):
            extra.append(f"{fmt_num(gen['failed'])} failed in generation, not validated")
    if s.get("bad_rows"):
        extra.append(f"{s['bad_rows']:,} bad rows skipped")
    return text + (f" ({'; '.join(extra)})" if extra else "")


# -- view data -----------------------------------------------------------------------------------
def _dataset_view(d: DatasetReport) -> dict[str, Any]:
    """Everything the templates draw for one dataset, with chart geometry already computed."""
    s = d.summary()
    gate = d.gate or {}
    hist = s["first_diff_histogram"]
    mismatches = list((d.validation or {}).get("mismatches") or [])
    return {
        "d": d,
        "s": s,
        "status": "passed" if gate.get("passed") else ("failed" if gate else "no report"),
        "gate": gate,
        "class_bars": _class_bars(s["counts"], s["samples"]) if d.validation is not None else None,
        "threshold_bars": _threshold_bars(s) if d.validation is not None else None,
        "first_diff": _histogram(hist["edges"], hist["counts"], "#c62828") if hist["counts"] else None,
        "lengths": _lengths(d.lengths),
        "generation": _generation(d.generation),
        "billing": _billing(d.billing, d.thresholds.get("max_billing_deviation")),
        "prompt_billing": _prompt_billing((d.billing or {}).get("prompt")),
        "calibration": _calibration(d.calibration),
        "provider": _provider(s["identity"], s["policy"]),
        "policy": _policy_detail(d.policy),
        "examples": _examples(mismatches),
        "mismatches": mismatches,
        "bad_rows": [b for b in (d.validation or {}).get("bad_rows") or [] if isinstance(b, dict)],
    }


def class_color(cls: str) -> str:
    """A class's color; classes the gate adds later take a spare color by their place in `classes()`."""
    if cls in KNOWN_CLASS_COLORS:
        return KNOWN_CLASS_COLORS[cls]
    new = [c for c in classes() if c not in KNOWN_CLASS_COLORS]
    return _SPARE_COLORS[new.index(cls) % len(_SPARE_COLORS)] if cls in new else "#555"


# Bar charts: the labels' column is as wide as the longest label needs at the charts' 12 px font
# (LABEL_CHAR_PX: a sans-serif's wide average, digits and lowercase), the bars keep BAR_AREA_PX.
# A fixed 110 px cut "unreconstructable" to "nreconstructable" (the label is right-aligned).
LABEL_CHAR_PX = 7.0
BAR_AREA_PX = 310


def label_width(labels) -> int:
    return max(110, 14 + int(LABEL_CHAR_PX * max((len(str(x)) for x in labels), default=0) + 0.5))


def _class_bars(counts: Mapping[str, int], samples: int) -> dict[str, Any]:
    bar_h, gap, label_w = 26, 10, label_width(counts)
    width = label_w + BAR_AREA_PX
    top = max(1, max(counts.values(), default=0))
    rows = []
    for i, c in enumerate(counts):
        w = (width - label_w - 90) * counts[c] / top
        share = f" ({counts[c] / samples:.1%})" if samples else ""
        rows.append(
            {"label": c, "y": i * (bar_h + gap), "w": w, "color": class_color(c), "value": f"{counts[c]:,}{share}"}
        )
    return {"width": width, "height": len(counts) * (bar_h + gap), "bar_h": bar_h, "label_w": label_w, "rows": rows}


def _threshold_bars(s: Mapping[str, Any]) -> dict[str, Any]:
    """Each class rate with a marker at its threshold: a bar past its marker is what failed."""
    rates = rate_thresholds(s["rates"], s["thresholds"])
    bar_h, gap, label_w = 26, 22, label_width(c for c, _, _ in rates)
    width = label_w + BAR_AREA_PX
    scale_max = max([0.01] + [r for _, r, _ in rates] + [t for _, _, t in rates if t is not None]) * 1.15
    inner = width - label_w - 20
    rows = []
    for i, (c, rate, threshold) in enumerate(rates):
        x = label_w + inner * threshold / scale_max if threshold is not None else None
        rows.append(
            {
                "label": c,
                "y": i * (bar_h + gap) + 4,
                "w": inner * rate / scale_max,
                "rate": rate,
                "over": threshold is not None and rate > threshold,
                "threshold": threshold,
                "x": x,
                "marker_x": min(x + 4, width - 90) if x is not None else None,
            }
        )
    return {
        "width": width,
        "height": len(rates) * (bar_h + gap) + 6,
        "bar_h": bar_h,
        "label_w": label_w,
        "inner": inner,
        "rows": rows,
    }


LABEL_FONT_PX = 10  # the bins' range labels, drawn upright under their bars
LABEL_FONT_CHAR_PX = 6.2


def _histogram(edges: Sequence[float], counts: Sequence[int], color: str, closed_last: bool = False) -> dict[str, Any]:
    """A histogram's geometry, each bar labelled by its range (`edge_labels`): a person reads
    which values a bar holds without hovering; the labels run upwards under their bars, so the
    chart is as tall as its longest label needs. `closed_last`: the last bin holds its upper edge
    (numpy's histogram)."""
    labels = edge_labels(edges)
    ranges = [
        f"[{labels[i]}, {labels[i + 1]}{']' if closed_last and i == len(counts) - 1 else ')'}"
        for i in range(len(counts))
    ]
    width, left = 420, 40
    bottom = 12 + int(LABEL_FONT_CHAR_PX * max((len(r) for r in ranges), default=0) + 0.5)
    inner_h = 122
    height = 14 + inner_h + bottom
    top = max(1, max(counts, default=0))
    inner_w = width - left - 10
    bw = inner_w / max(1, len(counts))
    bars = []
    for i, n in enumerate(counts):
        h = inner_h * n / top
        bars.append(
            {
                "x": left + i * bw + 1,
                "y": 14 + inner_h - h,
                "w": max(1.0, bw - 2),
                "h": h,
                "lo": edges[i],
                "hi": edges[i + 1],
                "n": n,
                "label": ranges[i],
                "label_x": left + (i + 0.5) * bw,
            }
        )
    return {
        "width": width,
        "height": height,
        "left": left,
        "inner_w": inner_w,
        "inner_h": inner_h,
        "top": top,
        "color": color,
        "bars": bars,
        "label_y": 14 + inner_h + 5,
    }


def edge_labels(edges: Sequence[float]) -> list[str]:
    """The edges as text, rounded to the fewest decimals (up to 6) that keep every finite edge
    distinct, so no two bins read alike ("-20, -20" was -20 and -19.75 at no decimals);
    infinite edges as -inf/inf."""
    import math

    finite = [float(e) for e in edges if math.isfinite(e)]
    digits = 0
    if not all(float(e).is_integer() for e in finite):
        digits = next((k for k in range(1, 7) if len({round(e, k) for e in finite}) == len(set(finite))), 6)

    def one(e: float) -> str:
        if math.isinf(e):
            return "-inf" if e < 0 else "inf"
        return f"{round(float(e), digits) + 0.0:,.{digits}f}"  # + 0.0: no "-0"

    return [one(e) for e in edges]


def _lengths(lengths: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    figs = []
    for key, st in sorted((lengths or {}).items()):
        if not isinstance(st, dict) or not st.get("counts"):
            continue
        caption = (
            f"{key}: n={st.get('count', 0):,}, mean {fmt_num(st.get('mean'))}, p50 {fmt_num(st.get('p50'))}, "
            f"p95 {fmt_num(st.get('p95'))}, max {fmt_num(st.get('max'))}"
        )
        figs.append({"caption": caption, "chart": _histogram(st["edges"], st["counts"], "#1565c0")})
    return figs


def _generation(generation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    cols = ("ok", "failed", "prompt_tokens", "completion_tokens", "cost_usd")
    rows = []
    for path in ("local", "overflow"):
        t = (generation or {}).get(path)
        if isinstance(t, dict):
            rows.append((path, [fmt_usd(t.get(c)) if c == "cost_usd" else fmt_num(t.get(c)) for c in cols]))
    return (
        {
            "head": [c.replace("_", " ") for c in cols],
            "rows": rows,
            "conversations": _conversations((generation or {}).get("conversations")),
            "trajectories": _trajectories((generation or {}).get("trajectories")),
            "images": _images((generation or {}).get("images")),
        }
        if rows
        else None
    )


def _images(counts: Mapping[str, Any] | None) -> list[tuple[str, str]] | None:
    """The dataset's image prompts (prompts.IMAGE_COUNTS), when it had any."""
    if not isinstance(counts, dict) or not counts:
        return None
    labels = (
        ("image_rows", "prompt rows with images"),
        ("images", "images"),
        ("media_tokens", "media tokens (never trained on)"),
        ("image_rejects", "rows refused for an image"),
    )
    return [(label, fmt_num(counts.get(key, 0))) for key, label in labels]


def _trajectories(counts: Mapping[str, Any] | None) -> list[tuple[str, str]] | None:
    """What the merge made of the trajectories (merge._fold): samples kept whole, kept up to their
    last usable turn (and which status cut them), dropped; turn rows folded into a record, made
    the record, dropped. Each group adds up to its first line."""
    if not isinstance(counts, dict) or not counts.get("trajectory_samples"):
        return None

    def n(key: str, reasons: str | None = None) -> str:
        why = ", ".join(
            f"{k[len(reasons) :]} {fmt_num(v)}" for k, v in sorted(counts.items()) if reasons and k.startswith(reasons)
        )
        return fmt_num(counts.get(key, 0)) + (f" ({why})" if why else "")

    return [
        ("samples", n("trajectory_samples")),
        ("kept whole", n("trajectory_samples_whole")),
        ("kept up to their last usable turn", n("trajectory_samples_cut", "trajectory_cut_")),
        ("dropped: no usable turn", n("trajectory_samples_dropped", "trajectory_dropped_")),
        ("not folded: prompts not chained", n("trajectory_samples_unfolded")),
        ("turn rows", n("trajectory_turns")),
        ("folded into a later turn's record", n("trajectory_turns_folded")),
        ("made a record", n("trajectory_turns_record")),
        ("dropped: unusable, or after an unusable turn", n("trajectory_turns_dropped")),
    ]


def _conversations(by_path: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Samples made in rounds (conversations.figures), per path: how many, turns per
    sample, trajectory lengths, why they ended, the tool-result splices."""
    if not isinstance(by_path, dict) or not by_path:
        return None
    rows = []
    for path, f in by_path.items():
        if not isinstance(f, dict):
            continue
        lengths = ", ".join(f"{k}: {v}" for k, v in (f.get("turns_per_sample") or {}).items())
        ends = ", ".join(f"{k} {v}" for k, v in (f.get("end") or {}).items())
        rows.append(
            (
                path,
                [
                    str(f.get("mode", "")),
                    fmt_num(f.get("samples")),
                    fmt_num(f.get("turns")),
                    lengths,
                    ends,
                    f"{fmt_num(f.get('splice_hits'))} / {fmt_num(f.get('splice_misses'))}",
                    f"{fmt_num(f.get('exact_turns'))} of {fmt_num(f.get('earlier_turns'))}",
                    fmt_num(f.get("not_prefix")),
                    fmt_num(f.get("user_turns_not_reached")),
                ],
            )
        )
    head = [
        "mode",
        "samples",
        "turns",
        "turns per sample (turns: samples)",
        "ended",
        "splices hit / missed",
        "earlier turns with the engine's ids",
        "prompts not chained",
        "user turns not reached",
    ]
    return {"head": head, "rows": rows} if rows else None


def _billing(billing: Mapping[str, Any] | None, max_dev: float | None) -> dict[str, Any] | None:
    """Billed (provider's own tokenizer) vs reconstructed completion tokens of the overflow rows."""
    excluded = billing.get("excluded") if isinstance((billing or {}).get("excluded"), dict) else {}
    if not billing or not (billing.get("rows") or excluded.get("rows")):
        return None
    if max_dev is None:
        max_dev = (billing.get("gate") or {}).get("max_aggregate_deviation")
    dev = billing.get("deviation")
    rows = [
        ("overflow rows", fmt_num(billing.get("rows"))),
        ("completion tokens billed", fmt_num(billing.get("billed_completion_tokens"))),
        ("completion tokens reconstructed", fmt_num(billing.get("reconstructed_completion_tokens"))),
        ("aggregate deviation", fmt_pct(dev, 3) + (f" (max ±{max_dev:.2%})" if is_number(max_dev) else "")),
        ("mean |sample deviation|", fmt_pct(billing.get("mean_abs_sample_deviation"), 3)),
    ]
    if excluded.get("rows"):  # unreconstructable rows: their gap says nothing about reconstruction
        rows.append(
            (
                "excluded, unreconstructable",
                f"{fmt_num(excluded['rows'])} rows, {fmt_num(excluded.get('billed_completion_tokens'))} tokens billed",
            )
        )
        reasons = excluded.get("reasons") if isinstance(excluded.get("reasons"), dict) else {}
        rows += [(f"reason: {why}", fmt_num(n)) for why, n in sorted(reasons.items())]
    worst = [w for w in billing.get("worst_samples") or [] if isinstance(w, dict)][:5]
    return {
        "over": is_number(dev) and is_number(max_dev) and abs(dev) > max_dev,
        "rows": rows,
        "worst": [
            (
                str(w.get("sample_id")),
                fmt_num(w.get("billed")),
                fmt_num(w.get("reconstructed")),
                fmt_pct(w.get("deviation")),
            )
            for w in worst
        ],
        "notes": [str(n) for n in (billing.get("gate") or {}).get("notes") or []],
    }


def _prompt_billing(prompt: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Billed prompt tokens (the provider's render, its tokenizer) against the prompt ids we
    train on, per overflow answer (stages.validate.billing.compare_billed_prompts): the figures, the
    distribution of billed - ours, and the answers furthest off."""
    if not isinstance(prompt, dict) or not (prompt.get("rows") or (prompt.get("missing_usage") or {}).get("rows")):
        return None
    gate = prompt.get("gate") if isinstance(prompt.get("gate"), dict) else {}
    over = prompt.get("over_tolerance") if isinstance(prompt.get("over_tolerance"), dict) else {}
    missing = prompt.get("missing_usage") if isinstance(prompt.get("missing_usage"), dict) else {}
    limit = gate.get("max_mean_abs_diff")
    rows = [
        ("answers compared", fmt_num(prompt.get("rows"))),
        ("prompt tokens billed", fmt_num(prompt.get("billed_prompt_tokens"))),
        ("prompt tokens of our prompt ids", fmt_num(prompt.get("prompt_ids_tokens"))),
        (
            "mean |billed - ours| per answer",
            _tokens(prompt.get("mean_abs_diff")) + (f" (max {limit:g})" if is_number(limit) else ""),
        ),
        ("mean billed - ours per answer", _tokens(prompt.get("mean_diff"), signed=True)),
        (
            f"answers off by more than {gate.get('max_row_diff', '?')}",
            f"{fmt_num(over.get('rows'))} ({fmt_pct(over.get('rate'))})",
        ),
        ("answers without usage.prompt_tokens", fmt_num(missing.get("rows"))),
    ]
    distribution = [
        (str(p[0]), fmt_num(p[1]))
        for p in prompt.get("diff_distribution") or []
        if isinstance(p, (list, tuple)) and len(p) == 2
    ]
    worst = [w for w in prompt.get("worst_samples") or [] if isinstance(w, dict) and w.get("diff")][:5]
    return {
        "over": gate.get("passed") is False,
        "rows": rows,
        "distribution": distribution,
        "worst": [
            (
                str(w.get("sample_id")),
                fmt_num(w.get("billed")),
                fmt_num(w.get("ours")),
                _tokens(w.get("diff"), signed=True),
            )
            for w in worst
        ],
    }


def _tokens(value: Any, signed: bool = False) -> str:
    if not is_number(value):
        return "—"
    return (
        (f"{value:+,.2f}" if signed else f"{value:,.2f}")
        if isinstance(value, float)
        else (f"{value:+,d}" if signed else f"{value:,d}")
    )


def _provider(identity: Mapping[str, Any] | None, policy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Who answered and whether their text is the target's: the identity counts and the policy
    check's figures (both gate the dataset; the reasons are in the gate's list)."""
    if identity is None and policy is None:
        return None
    rows: list[tuple[str, str, bool]] = []
    if identity is not None:
        rows += [
            ("answers checked", fmt_num(identity.get("answered")), False),
            (
                "not the pinned model/provider",
                f"{fmt_num(identity.get('mismatched'))} ({fmt_pct(identity.get('rate'))})",
                identity.get("passed") is False,
            ),
        ]
        rows += [(f"served by {who}", fmt_num(n), False) for who, n in list((identity.get("served") or {}).items())[:5]]
    if policy is not None:
        for side in ("local", "overflow"):
            if isinstance(policy.get(side), dict):
                fig = policy[side]
                rows.append(
                    (
                        f"{side}: samples / tokens / mean log-prob",
                        f"{fmt_num(fig.get('samples'))} / {fmt_num(fig.get('tokens'))} / "
                        f"{_nats(fig.get('mean_logprob'))}",
                        False,
                    )
                )
        if policy.get("gap_nats_per_token") is not None:
            rows.append(
                (
                    "policy gap (nats/token, local minus overflow)",
                    _nats(policy["gap_nats_per_token"]),
                    policy.get("passed") is False,
                )
            )
        rows += _policy_tests(policy)
    notes = [f"{n}x {why}" for why, n in ((identity or {}).get("reasons") or {}).items()]
    # the power note and the UNDERPOWERED note are the policy statement's (`policy_statement`), said once there
    policy_notes = [
        n for n in (policy or {}).get("notes") or [] if not str(n).startswith(("policy power: ", "policy UNDERPOWERED"))
    ]
    return {
        "rows": rows,
        "reasons": list((policy or {}).get("reasons") or []),
        "notes": notes + policy_notes,
    }


def _policy_tests(policy: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """The count tests' counts (nucleus, greedy: "a of n" tokens outside, of those checked, per
    path) and p-values, the calibration pairs, and how the sample was sized. The mean tests'
    shifts and every test's power are the policy statement's (`policy_statement`): said once, in
    sentences, under the table."""
    rows: list[tuple[str, str, bool]] = []
    for name, label in (("nucleus", "nucleus: tokens outside"), ("greedy", "greedy: tokens off the target's argmax")):
        t = (policy.get("tests") or {}).get(name)
        if not isinstance(t, dict):
            continue
        (n, m), (a, b) = t["tokens"], t["outside"]
        rows.append(
            (
                f"{label}, local / overflow / p-value (level)",
                f"{fmt_num(a)} of {fmt_num(n)} / {fmt_num(b)} of {fmt_num(m)} / {_p(t.get('p_value'))} "
                f"({_p(t.get('alpha'))})",
                bool(t.get("rejected")),
            )
        )
    pairs = policy.get("pairs") or {}
    if pairs.get("samples"):
        rows.append(
            (
                "calibration pairs: prompts / same ids on both paths / mean difference",
                f"{fmt_num(pairs['samples'])} / {fmt_num(pairs.get('identical_ids'))} / "
                f"{_nats(pairs.get('mean_difference'))}",
                False,
            )
        )
    sizing = policy.get("sizing") or {}
    if sizing:
        rows.append(
            (
                "policy sample size: pilot / required a side / scored a side",
                f"{fmt_num(sizing.get('pilot'))} / {fmt_num(sizing.get('required'))} / {fmt_num(sizing.get('chosen'))}",
                False,
            )
        )
    return rows


SIDE_COLORS = {"local": "#2e7d32", "overflow": "#ef6c00"}  # the policy charts' paths
LOGPROB_BINS = 20


def _policy_detail(policy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the policy check saw, from its committed figures: each path's per-sample mean
    log-probabilities as histograms on shared bins (a fault moves one path's mass), the
    calibration pairs (same prompt, greedy on both paths), the power statement, and each path's
    least likely answers with their tokens decoded (the likeliest garbage; texts are untrusted,
    autoescaped by the template)."""
    figures = (policy or {}).get("figures")
    if not isinstance(figures, dict) or figures.get("skipped"):
        return None
    means = {
        side: [m for m in (figures.get(side) or {}).get("sample_means") or [] if is_number(m)] for side in SIDE_COLORS
    }
    pairs = figures.get("pairs") if isinstance(figures.get("pairs"), dict) else {}
    pair_rows = [
        (str(sid), _nats(lo), _nats(ov), _nats(lo - ov) if is_number(lo) and is_number(ov) else "-")
        for sid, lo, ov in zip(
            pairs.get("sample_ids") or [], pairs.get("local_means") or [], pairs.get("overflow_means") or []
        )
    ]
    power = policy_statement(policy or {})
    worst = {
        side: [
            {
                "sample_id": str(w.get("sample_id")),
                "route": str(w.get("route")),
                "mean": _nats(w.get("mean_logprob")),
                "tokens": fmt_num(w.get("tokens")),
                "pieces": [(str(t), _nats(lp)) for t, lp in zip(w.get("texts") or [], w.get("logprobs") or [])],
            }
            for w in ((figures.get("worst") or {}).get(side) or [])
            if isinstance(w, dict)
        ]
        for side in SIDE_COLORS
    }
    return {
        "histograms": logprob_histograms(means),
        "pairs": pair_rows,
        "power": power,
        "worst": {side: rows for side, rows in worst.items() if rows},
    }


def policy_statement(policy: Mapping[str, Any]) -> list[str] | None:
    """The policy check in sentences, once: per test what it counted, what it found, and the
    smallest effect it could see with these samples (its power), from the decision's own figures
    (policy.compare.decide). The nucleus counts say which tokens they count (outside the nucleus,
    of those checked, per path), so "0 of 91" and "91 checked" cannot be read as each other."""
    decision = policy.get("decision") if isinstance(policy.get("decision"), dict) else {}
    tests, th = decision.get("tests") or {}, decision.get("thresholds") or {}
    if not tests:
        return None
    power = fmt_pct(th.get("power"), 0)
    out = []
    for name, what in (
        ("nucleus", "answer tokens lie outside the nucleus their sampling allows (top_p/top_k)"),
        ("greedy", "greedy calibration answer tokens are not the target's argmax"),
    ):
        t = tests.get(name)
        if not isinstance(t, dict):
            continue
        (n, m), (a, b) = t["tokens"], t["outside"]
        mdr = t.get("min_detectable_rate")
        seen = "no rate at all with this few tokens" if mdr is None else f"an overflow rate of {fmt_pct(mdr)}"
        out.append(
            f"{name.capitalize()} test: {fmt_num(a)} of the {fmt_num(n)} local and {fmt_num(b)} of the "
            f"{fmt_num(m)} overflow {what} (p = {_p(t.get('p_value'))}, rejected below {_p(t.get('alpha'))}: "
            f"{'REJECTED' if t.get('rejected') else 'not rejected'}). With these counts it detects {seen} "
            f"with {power} power{', too little: UNDERPOWERED' if t.get('underpowered') else ''}."
        )
    for name, what in (("sampled", "sampled answers"), ("pairs", "calibration pairs (same prompt, greedy)")):
        t = tests.get(name)
        if not isinstance(t, dict):
            out.append(f"The {what} test did not run (fewer than 2 a side).")
            continue
        n = list(t.get("samples") or [])
        sizes = (
            f"{' + '.join(fmt_num(x) for x in n)} samples, local + overflow"
            if len(n) > 1
            else f"{fmt_num(sum(n))} pairs"
        )
        out.append(
            f"The {what} test ({sizes}) measured a shift of {_nats(t.get('shift'))} "
            f"+- {_nats(t.get('standard_error'))} nats/token in mean log-probability (p = {_p(t.get('p_value'))}, "
            f"rejected below {_p(t.get('alpha'))}: {'REJECTED' if t.get('rejected') else 'not rejected'}). "
            f"It detects a shift of {_nats(t.get('min_detectable_shift'))} nats/token with {power} power"
            + (
                f", more than the {_nats(th.get('shift'))} that matters: UNDERPOWERED (score more: "
                "policy.max_samples, or more overflow answers)."
                if t.get("underpowered")
                else "."
            )
        )
    if "nucleus" not in tests:
        out.append("The nucleus test did not run (the sampling has no nucleus to check, or no token was checked).")
    return out


def logprob_histograms(means: Mapping[str, Sequence[float]], bins: int = LOGPROB_BINS) -> list[dict[str, Any]]:
    """One histogram per path of its samples' mean log-probabilities (nats/token), all on the
    same edges so their shapes compare at a glance."""
    import numpy as np

    values = [v for vs in means.values() for v in vs]
    if not values:
        return []
    lo, hi = float(np.floor(min(values) * 2) / 2), float(np.ceil(max(values) * 2) / 2)
    edges = np.linspace(lo, hi if hi > lo else lo + 0.5, bins + 1)
    out = []
    for side, vs in means.items():
        if vs:
            counts, _ = np.histogram(vs, edges)
            out.append(
                {
                    "caption": f"{side}: {len(vs):,} samples, mean {float(np.mean(vs)):.3f} nats/token",
                    "chart": _histogram(
                        [float(e) for e in edges], [int(c) for c in counts], SIDE_COLORS.get(side, "#555"), True
                    ),
                }
            )
    return out


SOURCE_SIDES = {"sglang": "local", "vllm": "local", "openrouter": "overflow"}  # policy_check's paths


def every_row_histograms(logprobs: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The extraction's per-path histograms of per-sample mean log-probabilities
    (target_head.logprobs.LogprobStats: bin 0 below the first edge, the last at or above the
    last), on its fixed edges, empty bins at either end left out."""
    if not isinstance(logprobs, Mapping):
        return []
    edges = [float(e) for e in logprobs.get("histogram_edges") or []]
    out = []
    for source, side in (logprobs.get("sources") or {}).items():
        counts = side.get("histogram") if isinstance(side, Mapping) else None
        if not edges or not isinstance(counts, list) or len(counts) != len(edges) + 1 or not sum(counts):
            continue
        full = [float("-inf"), *edges, float("inf")]
        used = [i for i, n in enumerate(counts) if n]
        a, b = used[0], used[-1] + 1
        out.append(
            {
                "caption": f"{source}: {fmt_num(side.get('samples'))} samples",
                "chart": _histogram(
                    full[a : b + 1], counts[a:b], SIDE_COLORS.get(SOURCE_SIDES.get(source, ""), "#555")
                ),
            }
        )
    return out


def _p(v: Any) -> str:
    return f"{v:.2g}" if is_number(v) else "-"


def _nats(v: Any) -> str:
    return f"{v:.4f}" if is_number(v) else "-"


def _calibration(cal: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Samples generated on both paths: engine ids vs the provider's reconstructed text. Informational,
    not a gate; a text disagreement points at a different model, template or reasoning setting."""
    if cal is None:
        return None
    s = calibration_summary(cal)
    disagree = s["text_disagreements"] if isinstance(s["text_disagreements"], list) else []
    rows = [
        ("samples compared", fmt_num(s["samples"]), False),
        (f"token agreement, first {fmt_num(s['first_n'])} ids", fmt_pct(s["agreement"]), False),
        ("text agreement", fmt_pct(s["text_agreement"]), False),
        ("mean agreeing prefix (ids)", fmt_num(s["mean_agreeing_prefix"]), False),
        ("text disagreements", fmt_num(len(disagree)), bool(disagree)),
        ("missing on a path", fmt_num(s["missing"]), False),
        ("unreconstructable", fmt_num(s["unreconstructable"]), False),
    ]
    differing = [
        p
        for p in cal.get("per_sample") or []
        if isinstance(p, dict) and (p.get("first_diff") is not None or not p.get("same_text", True))
    ]
    differing.sort(key=lambda p: bool(p.get("same_text")))  # text disagreements first
    shown = differing[:MAX_CALIBRATION_ROWS]
    return {
        "rows": rows,
        "disagreements": len(disagree),
        "samples": [
            {
                "sample_id": str(p.get("sample_id")),
                "first_diff": fmt_num(p.get("first_diff")),
                "agreeing_prefix": fmt_num(p.get("agreeing_prefix")),
                "same_text": bool(p.get("same_text")),
                "engine_text": str(p.get("engine_text", "")),
                "provider_text": str(p.get("provider_text", "")),
            }
            for p in shown
        ],
        "more": len(differing) - len(shown),
        "proof": [
            (label, str(cal[key]))
            for key, label in (("can_prove", "Can prove"), ("cannot_prove", "Cannot prove"))
            if cal.get(key)
        ],
    }


def _examples(mismatches: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The worst mismatches first: classes later in CLASSES are the more severe."""
    if not mismatches:
        return None
    severity = {c: i for i, c in enumerate(reversed(classes()))}
    shown = sorted(mismatches, key=lambda m: severity.get(str(m.get("class")), len(severity)))[:MAX_EXAMPLES]
    items = [
        {
            "cls": str(m.get("class", "?")),
            "color": class_color(str(m.get("class", "?"))),
            "sample_id": str(m.get("sample_id", "?")),
            "first_diff": str(m.get("first_diff")),
            "original": _token_list(m.get("original")),
            "reconstructed": _token_list(m.get("reconstructed")),
        }
        for m in shown
    ]
    return {"items": items, "total": len(mismatches), "more": len(mismatches) - len(shown)}


def _token_list(seq: Any) -> list[Any] | None:
    """The differing span (validate.py stores up to 8 tokens from the first difference), or None
    when the report holds something else there."""
    return seq if isinstance(seq, list) else None


# -- formatting (template filters) ---------------------------------------------------------------
def fmt_pct(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}%}" if is_number(v) else "—"


def fmt_usd(v: Any) -> str:
    return f"${v:,.4f}" if is_number(v) else "—"


def fmt_bytes(v: Any) -> str:
    from eagle3_data.storage_estimate import human_bytes

    return human_bytes(v) if is_number(v) else "-"


def fmt_num(v: Any) -> str:
    if not is_number(v):
        return "—"
    return f"{v:,.1f}" if isinstance(v, float) and not v.is_integer() else f"{int(v):,}"


def note_sentences(note: Any) -> str:
    """A policy gate note as sentences: "policy power: a; b" (policy.compare.power_statement's
    clauses) reads "Power of the check: A. B."; any other note gets its full stop."""
    text = str(note).strip()
    head, clauses = "", [text]
    if text.startswith("policy power: "):
        head, clauses = "Power of the check: ", text.removeprefix("policy power: ").split("; ")
    return head + " ".join(c[:1].upper() + c[1:] + ("" if c.endswith(".") else ".") for c in clauses if c)


def token_text(token: Any) -> str:
    """A token as shown in its box: spaces as ·, newlines as ↵, so whitespace and BPE splits are visible."""
    return str(token).replace(" ", "·").replace("\n", "↵")


def md_tokens(tokens: Any) -> str:
    """A token list as one Markdown code cell: repr shows whitespace; `|` and backticks cannot break the table."""
    return "`" + repr(tokens).replace("|", "\\|").replace("`", "'") + "`"


def md_cell(value: Any) -> str:
    """Untrusted text outside a code span: one line, `|` cannot end a table cell and `<` cannot
    open raw HTML in a viewer that renders it."""
    return str(value).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


@cache
def _env() -> jinja2.Environment:
    """One environment per process (templates compile once). HTML templates autoescape; the
    Markdown template does not (it is not HTML, and escapes its table cells itself)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("eagle3_data.report", "templates"),
        autoescape=jinja2.select_autoescape(
            enabled_extensions=("html.jinja",), disabled_extensions=("md.jinja",), default=True
        ),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(
        pct=fmt_pct,
        usd=fmt_usd,
        num=fmt_num,
        tok=token_text,
        sentences=note_sentences,
        md_tokens=md_tokens,
        md_cell=md_cell,
        commas="{:,}".format,
        commas_g="{:,g}".format,
        g="{:g}".format,
        bytes=fmt_bytes,
    )
    return env
