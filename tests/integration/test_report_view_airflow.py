"""The validation-report plugin inside a real Airflow api-server: auth, routing, numbers, outages.

One api-server (own AIRFLOW_HOME, SQLite, SimpleAuthManager with a password user, loopback, free
port) loads plugins/ and reads a report written into a real SeaweedFS bucket through the
`aws_default` connection (in the metadata DB, edited through the REST API as an admin would),
exactly as in a deployment.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import yaml

from eagle3_data.config import DEFAULT_CONFIG_PATH
from eagle3_data.dev.processes import free_port, wait_http_ok
from eagle3_data.report import length_stats, write_run_report
from eagle3_data.stages.validate import CLASSES
from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_devtools.stack import airflow_env

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DAG_ID = "eagle3_view_probe"
RUN_NAME = "view-probe"
EVIL = "<img src=x onerror=alert(1)>"

PROBE_DAG = f"""
from airflow.sdk import dag, task

@dag(dag_id="{DAG_ID}", schedule=None, catchup=False)
def probe():
    @task
    def noop():
        return None
    noop()

probe()
"""


def write_report(store: ArtifactStore) -> None:
    ref = StageRef(RUN_NAME, "validate", "tool_calls")
    report = {
        "samples": 40,
        "counts": {"exact": 37, "bpe_only": 2, "special_token": 0, "text_diff": 1},
        "sample_mismatch_rate": 0.075,
        "token_agreement": 0.9984,
        "mismatches": [
            {
                "sample_id": "tc-07",
                "class": "text_diff",
                "first_diff": 17,
                "original": ["The", " answer", EVIL],
                "reconstructed": ["The", " answer", " is"],
            },
            {
                "sample_id": "tc-11",
                "class": "bpe_only",
                "first_diff": 230,
                "original": [" N", "OR"],
                "reconstructed": [" NOR"],
            },
            {
                "sample_id": "tc-12",
                "class": "bpe_only",
                "first_diff": 5,
                "original": [" N", "OR"],
                "reconstructed": [" NOR"],
            },
        ],
        "bad_rows": [],
        "gate": {"passed": False, "reasons": ["text_diff rate 2.50% > max 0.00%"]},
    }
    write_run_report(
        store,
        RUN_NAME,
        {
            "tool_calls": {
                "validation": store.put_json(ref, "report.json", report),
                "billing": store.put_json(
                    ref,
                    "billing.json",
                    {
                        "rows": 9,
                        "billed_completion_tokens": 18321,
                        "reconstructed_completion_tokens": 18318,
                        "deviation": -0.000164,
                    },
                ),
                "lengths": {
                    "prompt_tokens": length_stats([300, 420, 512, 2048]),
                    "output_tokens": length_stats([64, 900, 901]),
                },
                "generation": {
                    "overflow": {
                        "ok": 9,
                        "failed": 0,
                        "prompt_tokens": 4100,
                        "completion_tokens": 18321,
                        "cost_usd": 0.41177,
                    }
                },
                "thresholds": {"max_bpe_mismatch_rate": 0.1, "max_text_diff_rate": 0.0, "max_billing_deviation": 0.01},
            }
        },
        dag_id=DAG_ID,
    )


def aws_extra(endpoint_url: str) -> dict:
    """`aws_default`'s extra; one attempt, so a refused connection answers at once."""
    return {
        "endpoint_url": endpoint_url,
        "region_name": "us-east-1",
        "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2},
    }


@pytest.fixture(scope="module")
def api_server(tmp_path_factory, s3_server, airflow_db_template):
    """(base_url, admin password, env) of a running api-server with the plugin; stopped by PID.

    Its home gets a copy of the session's freshly migrated DB (no second `airflow db migrate`),
    and `dags reserialize` runs while the api-server starts: both are Airflow start-ups of
    seconds of CPU each, and the server needs the DAG only when the first run is created."""
    home = tmp_path_factory.mktemp("airflow-view")
    (home / "dags").mkdir()
    (home / "dags" / "probe.py").write_text(PROBE_DAG)
    password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(json.dumps({"admin": password}))

    bucket = f"view-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    cfg = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    cfg["storage"]["bucket"] = bucket
    (home / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    store = ArtifactStore(s3_server.client(), bucket, cfg["storage"]["prefix"])
    write_report(store)

    env = {
        **os.environ,
        **airflow_env(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",  # all-admins signs everyone in
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "EAGLE3_CONFIG": str(home / "pipeline.yaml"),
    }
    shutil.copyfile(airflow_db_template, home / "airflow.db")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = home / "api-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "airflow"), "api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        subprocess.run(
            [str(BIN / "airflow"), "dags", "reserialize"], env=env, check=True, capture_output=True, timeout=300
        )
        wait_http_ok(f"{base}/api/v2/monitor/health", [proc], "api-server", log)
        r = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password})
        auth = {"Authorization": f"Bearer {r.json()['access_token']}"}
        r = httpx.post(
            f"{base}/api/v2/connections",
            headers=auth,
            json={
                "connection_id": "aws_default",
                "conn_type": "aws",
                "login": s3_server.access_key,
                "password": s3_server.secret_key,
                "extra": json.dumps(aws_extra(s3_server.endpoint_url)),
            },
        )
        assert r.status_code == 201, r.text
        yield base, password, env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started: server + its worker
        try:
            proc.wait(timeout=3)  # a throw-away server on a throw-away SQLite: no need to wait long
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def token(api_server) -> str:
    base, password, _ = api_server
    r = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password})
    assert r.status_code == 201, r.text
    return r.json()["access_token"]


@pytest.fixture(scope="module")
def runs(api_server, token) -> dict[str, str]:
    """A manual run named by conf.run_name (has a report) and a dated run (has none)."""
    base, _, _ = api_server
    auth = {"Authorization": f"Bearer {token}"}
    out = {}
    for kind, body in (
        ("named", {"logical_date": None, "conf": {"run_name": RUN_NAME}}),
        ("dated", {"logical_date": "2026-11-28T00:00:00Z", "conf": {}}),
    ):
        r = httpx.post(f"{base}/api/v2/dags/{DAG_ID}/dagRuns", json=body, headers=auth)
        assert r.status_code == 200, r.text
        out[kind] = r.json()["dag_run_id"]
    return out


def page_url(base: str, run_id: str, suffix: str = "") -> str:
    """The URL the UI builds from the external view's href (it encodeURIComponent()s the run id)."""
    return f"{base}/eagle3-report/{DAG_ID}/{quote(run_id, safe='')}{suffix}"


def test_anonymous_and_forged_requests_are_refused(api_server, runs):
    base, _, _ = api_server
    for suffix in ("", "/summary.json"):
        url = page_url(base, runs["named"], suffix)
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403
        assert httpx.get(url, cookies={"_token": "not-a-jwt"}).status_code == 403
        assert EVIL not in httpx.get(url).text and "18,321" not in httpx.get(url).text


def test_signed_in_user_gets_the_page(api_server, token, runs):
    base, _, _ = api_server
    for creds in ({"headers": {"Authorization": f"Bearer {token}"}}, {"cookies": {"_token": token}}):
        r = httpx.get(page_url(base, runs["named"]), **creds)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/html")
        html = r.text
        assert "view-probe" in html and "2.50%" in html and "max 0.00%" in html
        assert "18,321" in html and "$0.4118" in html and "-0.016% (max ±1.00%)" in html
        assert EVIL not in html and "&lt;img·src=x·onerror=alert(1)&gt;" in html  # spaces shown as ·
        assert html.count("<svg ") == 5


def test_summary_serves_the_numbers(api_server, token, runs):
    base, _, _ = api_server
    r = httpx.get(page_url(base, runs["named"], "/summary.json"), headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    (ds,) = r.json()["datasets"]
    assert r.json()["run_key"] == RUN_NAME
    assert ds["counts"] == {**dict.fromkeys(CLASSES, 0), "exact": 37, "bpe_only": 2, "text_diff": 1}
    assert ds["rates"]["text_diff"] == pytest.approx(0.025)
    assert ds["sample_mismatch_rate"] == pytest.approx(0.075)
    assert ds["billing"]["billed_completion_tokens"] == 18321
    assert ds["lengths"]["output_tokens"]["max"] == 901
    assert sum(ds["first_diff_histogram"]["counts"]) == 3


def test_runs_without_a_report_say_where_they_looked(api_server, token, runs):
    base, _, _ = api_server
    auth = {"Authorization": f"Bearer {token}"}
    r = httpx.get(page_url(base, runs["dated"]), headers=auth)
    assert r.status_code == 404 and "date=2026-11-28" in r.text and "run_report.json does not exist" in r.text
    assert httpx.get(page_url(base, "no-such-run"), headers=auth).status_code == 404


def test_plugin_registers_the_run_tab(api_server, token):
    base, _, _ = api_server
    r = httpx.get(f"{base}/api/v2/plugins", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    (plugin,) = [p for p in r.json()["plugins"] if p["name"] == "eagle3_validation_report"]
    (view,) = plugin["external_views"]
    assert view["href"] == "/eagle3-report/{DAG_ID}/{RUN_ID}" and view["destination"] == "dag_run"
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/eagle3-report"


def test_storage_outage_is_503_with_the_error_not_no_report(api_server, token, runs, s3_server):
    """S3 unreachable (aws_default pointed at a closed port) or the bucket gone: 503 naming the
    storage error in one line, not a 404 "no report"; the page is back once S3 answers."""
    base, _, env = api_server
    auth = {"Authorization": f"Bearer {token}"}
    page, summary = page_url(base, runs["named"]), page_url(base, runs["named"], "/summary.json")

    def point_aws_default_at(endpoint_url: str) -> None:
        r = httpx.patch(
            f"{base}/api/v2/connections/aws_default",
            params={"update_mask": "extra"},
            headers=auth,
            json={"connection_id": "aws_default", "conn_type": "aws", "extra": json.dumps(aws_extra(endpoint_url))},
        )
        assert r.status_code == 200, r.text

    point_aws_default_at(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        r = httpx.get(summary, headers=auth, timeout=60)
        assert r.status_code == 503, r.text
        detail = r.json()["detail"]
        assert "unreachable while reading s3://" in detail and "\n" not in detail
        r = httpx.get(page, headers=auth, timeout=60)
        assert r.status_code == 503 and "Storage unavailable: S3 at http://127.0.0.1:" in r.text
        assert "No validation report" not in r.text and s3_server.secret_key not in r.text
        assert httpx.get(summary, timeout=60).status_code == 401  # auth still comes first
    finally:
        point_aws_default_at(s3_server.endpoint_url)
    assert httpx.get(summary, headers=auth).status_code == 200

    config = Path(env["EAGLE3_CONFIG"])
    original = config.read_text()
    cfg = yaml.safe_load(original)
    cfg["storage"]["bucket"] = f"gone-{uuid.uuid4().hex[:12]}"
    config.write_text(yaml.safe_dump(cfg))
    try:
        r = httpx.get(summary, headers=auth)
        assert r.status_code == 503 and f"bucket '{cfg['storage']['bucket']}' does not exist" in r.json()["detail"]
        assert "s3 init" in r.json()["detail"]
    finally:
        config.write_text(original)
    assert httpx.get(page, headers=auth).status_code == 200
