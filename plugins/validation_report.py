"""Airflow plugin: the validation report of a DAG run, as a tab on the run's page.

A FastAPI app mounted by the api-server at /eagle3-report, plus an external view that links each
DAG run to it. The page shows prompt and model text, so every route requires a signed-in user
with read access to the DAG's runs: plugin apps are not behind Airflow's auth by default, so the
routes reuse the api-server's own dependency (`requires_access_dag`), which reads the JWT from the
`Authorization: Bearer` header or the UI's `_token` cookie and asks the configured auth manager.
The data and HTML come from `eagle3_data.report` (the run key from `eagle3_data.run_key`); this
file only wires Airflow to them. Answers: 200 the report (a dry run's: its plan); 404 no such
run, or no report or plan for it (yet); 503 S3 unreachable or its bucket missing (the report may
well exist: an outage is not "no report"); 401/403 from the auth dependency.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse

URL_PREFIX = "/eagle3-report"
TITLE = "EAGLE-3 validation report"

app = FastAPI(title=TITLE, docs_url=None, redoc_url=None, openapi_url=None)
_can_read_runs = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]


def _run_key(session, dag_id: str, run_id: str) -> str:
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    from eagle3_data.errors import UserError
    from eagle3_data.run_key import run_key_for

    dag_run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if dag_run is None:
        raise HTTPException(404, f"no run {run_id!r} of DAG {dag_id!r}")
    try:
        return run_key_for(dag_run.conf, dag_run.logical_date, dag_run.run_id)
    except UserError as exc:
        raise HTTPException(422, str(exc)) from None


def _store():
    """The pipeline's bucket, through the `aws_default` connection."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from eagle3_airflow import AWS_CONN_ID

    from eagle3_data.config import load_config
    from eagle3_data.storage import ArtifactStore

    storage = load_config().storage
    return ArtifactStore(S3Hook(aws_conn_id=AWS_CONN_ID).get_conn(), storage.bucket, storage.prefix)


def _load(run_key: str):
    """The run's report from the pipeline's bucket."""
    from eagle3_data.report import load_run_report

    return load_run_report(_store(), run_key)


def _plan(run_key: str):
    """A dry run's plan, (URI, plan), shown where its report would be; None without one."""
    from eagle3_data.report.plan_view import load_plan

    return load_plan(_store(), run_key)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


@app.get("/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=_can_read_runs)
def report_page(dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
    from eagle3_data.errors import UserError
    from eagle3_data.report import STORAGE_OUTAGES, render_html, render_missing, render_unavailable

    run_key = _run_key(session, dag_id, run_id)
    title = f"{TITLE}: {dag_id} / {run_id}"
    try:
        report = _load(run_key)
    except STORAGE_OUTAGES as exc:
        return HTMLResponse(render_unavailable(run_key, _one_line(exc), title=title), status_code=503)
    except UserError as exc:  # no index yet, or one this version cannot read
        try:
            plan = _plan(run_key)  # a dry run writes its plan instead
        except STORAGE_OUTAGES as outage:
            return HTMLResponse(render_unavailable(run_key, _one_line(outage), title=title), status_code=503)
        if plan is not None:
            from eagle3_data.report.plan_view import render_plan_html

            return HTMLResponse(render_plan_html(plan[1], plan[0], title=f"EAGLE-3 plan: {dag_id} / {run_id}"))
        return HTMLResponse(render_missing(run_key, str(exc), title=title), status_code=404)
    return HTMLResponse(render_html(report, title=title))


@app.get("/{dag_id}/{run_id}/summary.json", dependencies=_can_read_runs)
def report_summary(dag_id: str, run_id: str, session: SessionDep) -> dict[str, Any]:
    """The page's numbers, for scripts and tests."""
    from eagle3_data.errors import UserError
    from eagle3_data.report import STORAGE_OUTAGES

    run_key = _run_key(session, dag_id, run_id)
    try:
        return _load(run_key).summary()
    except STORAGE_OUTAGES as exc:
        raise HTTPException(503, _one_line(exc)) from None
    except UserError as exc:
        try:
            plan = _plan(run_key)  # a dry run: its plan
        except STORAGE_OUTAGES as outage:
            raise HTTPException(503, _one_line(outage)) from None
        if plan is not None:
            return {"run_key": run_key, "dry_run": True, "plan_uri": plan[0], "plan": plan[1]}
        raise HTTPException(404, str(exc)) from None


class ValidationReportPlugin(AirflowPlugin):
    # AirflowPlugin declares these as (mutable) instance attributes: a ClassVar may not override them
    name = "eagle3_validation_report"
    fastapi_apps: list[dict[str, Any]] = [{"app": app, "url_prefix": URL_PREFIX, "name": TITLE}]  # noqa: RUF012
    external_views: list[dict[str, Any]] = [  # noqa: RUF012
        {
            "name": "Validation report",
            "href": URL_PREFIX + "/{DAG_ID}/{RUN_ID}",
            "destination": "dag_run",
            "url_route": "eagle3_validation_report",
        }
    ]
