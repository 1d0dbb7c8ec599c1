"""`eagle3-data report`: a run's validation report (the Airflow tab's page) without Airflow."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("report", help="render a run's validation report as HTML, Markdown or JSON")
    p.add_argument("--run-key", required=True, help="date=YYYY-MM-DD or the run_name of a manual run")
    p.add_argument(
        "--config", default=None, help="pipeline config (default: $EAGLE3_CONFIG or the packaged pipeline.yaml)"
    )
    p.add_argument("--format", choices=["html", "markdown", "json"], default="html")
    p.add_argument("--out", default="-", help="file to write (default: stdout)")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    p.add_argument("--region", default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data.config import load_config
    from eagle3_data.errors import UserError
    from eagle3_data.report import load_run_report, render_html, render_markdown
    from eagle3_data.report.data import RUN_REPORT_NAME, run_report_ref
    from eagle3_data.storage import ArtifactStore, s3_client

    storage = load_config(args.config).storage
    store = ArtifactStore(s3_client(args.endpoint_url, args.region), storage.bucket, storage.prefix)
    if store.head_object(run_report_ref(args.run_key), RUN_REPORT_NAME) is None:
        raise UserError(
            f"run {args.run_key} has no report ({store.uri(run_report_ref(args.run_key), RUN_REPORT_NAME)} "
            f"does not exist): the DAG's publish task writes it; for a run made with the stage commands, "
            f"run `eagle3-data publish --run-key {args.run_key}` first"
        )
    report = load_run_report(store, args.run_key)
    title = f"EAGLE-3 validation report: {args.run_key}"
    if args.format == "json":
        text = json.dumps(report.summary(), indent=1, ensure_ascii=False) + "\n"
    elif args.format == "markdown":
        text = render_markdown(report, title=title)
    else:
        text = render_html(report, title=title)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0
