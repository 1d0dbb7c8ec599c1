"""A run's validation report: its data (`data`: the index, S3 loading, statistics) and its
rendering (`render`: HTML and Markdown through jinja2 templates). The Airflow plugin, the CLI and
the DAG's publish step import from here."""

from eagle3_data.report.data import (
    RUN_REPORT_NAME,
    STORAGE_OUTAGES,
    DatasetReport,
    RunReport,
    first_diff_histogram,
    generation_lengths,
    length_stats,
    load_run_report,
    run_report_ref,
    write_run_report,
)
from eagle3_data.report.render import render_html, render_markdown, render_missing, render_unavailable

__all__ = [
    "RUN_REPORT_NAME",
    "STORAGE_OUTAGES",
    "DatasetReport",
    "RunReport",
    "first_diff_histogram",
    "generation_lengths",
    "length_stats",
    "load_run_report",
    "render_html",
    "render_markdown",
    "render_missing",
    "render_unavailable",
    "run_report_ref",
    "write_run_report",
]
