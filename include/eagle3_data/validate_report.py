"""The validation report as Markdown, for the people deciding whether to train on the data."""

from __future__ import annotations

from typing import Any

MAX_LISTED = 50


def report_markdown(report: dict[str, Any], title: str = "Reconstruction validation") -> str:
    gate = report["gate"]
    lines = [
        f"# {title}",
        "",
        f"**Gate: {'PASSED' if gate['passed'] else 'FAILED'}**",
        *[f"- {r}" for r in gate["reasons"]],
        "",
        f"Samples: {report['samples']}; sample mismatch rate {report['sample_mismatch_rate']:.4%}; "
        f"token agreement {report['token_agreement']:.4%}.",
        "",
        "| class | samples |",
        "|---|---:|",
        *[f"| {cls} | {n} |" for cls, n in report["counts"].items()],
    ]
    if report["mismatches"]:
        lines += ["", "## Mismatches", "", "| sample_id | class | first_diff | original | reconstructed |", "|---|---|---:|---|---|"]
        for m in report["mismatches"][:MAX_LISTED]:
            lines.append(
                f"| {m['sample_id']} | {m['class']} | {m['first_diff']} | {_cell(m['original'])} | {_cell(m['reconstructed'])} |"
            )
        if len(report["mismatches"]) > MAX_LISTED:
            lines.append(f"\n{len(report['mismatches']) - MAX_LISTED} more in the JSON report.")
    if report["bad_rows"]:
        lines += ["", "## Bad rows (skipped)", ""]
        lines += [f"- {b['row']} sample_id={b['sample_id']} field `{b['field']}`: {b['error']}" for b in report["bad_rows"][:MAX_LISTED]]
    return "\n".join(lines) + "\n"


def _cell(tokens: list[str]) -> str:
    return "`" + repr(tokens).replace("|", "\\|").replace("`", "'") + "`"
