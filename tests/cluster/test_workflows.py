"""The users' workflows on the Celery cluster, over HTTP as the UI does them, and with the CLIs.

Every run reads its prompts from a date partition put in place by `eagle3-data prompts upload`
(the command a person uses before a backfill); each manual run has its own logical date
(Airflow keeps logical dates unique per DAG). Generation requests are counted by the dev
inference server, objects compared by ETag.
"""

from __future__ import annotations

import json
import time
from datetime import date

import httpx
import pytest

from eagle3_data.config import DAG_ID, GPU_QUEUE
from tests.cluster.conftest import KILLED_RUN, config, run_prefix, upload

FIRST = date(2026, 11, 1)  # the triggered run
BACKFILL = (date(2026, 11, 2), date(2026, 11, 3))
GPU_TASKS = {"dataset.generate_local", "extract_hidden_states"}


def by_dataset(objects: dict[str, str], prefix: str, dataset: str) -> dict[str, str]:
    """Objects of one dataset: runs/{key}/{stage}/{dataset}/..."""
    return {k: v for k, v in objects.items() if k[len(prefix):].split("/")[1:2] == [dataset]}


@pytest.fixture(scope="module")
def first_run(cluster) -> str:
    for ds in ("chat", "code"):
        upload(cluster, ds, FIRST)
    r = cluster.trigger("first", f"{FIRST}T00:00:00Z", {"datasets": ["chat", "code"]})
    assert r.status_code == 200, r.text
    assert cluster.wait_run("first") == "success", cluster.task_states("first")
    return "first"


def test_triggered_run_succeeds_with_gpu_tasks_on_the_gpu_worker(cluster, first_run):
    tis = cluster.task_instances(first_run)
    assert {t["state"] for t in tis} == {"success"}, cluster.task_states(first_run)
    placed = {(t["task_id"], t["queue"], t["hostname"]) for t in tis}
    for task_id, queue, host in placed:
        if task_id in GPU_TASKS:
            assert (queue, host) == (GPU_QUEUE, "gpu-worker"), (task_id, queue, host)
        else:
            assert (queue, host) == ("default", "default-worker"), (task_id, queue, host)
    assert {t for t, _, _ in placed} >= GPU_TASKS | {"audit_tokenizer", "dataset.load_route", "publish"}


def test_invalid_values_refused_at_trigger_time_naming_the_param(cluster):
    r = cluster.trigger("bad-value", "2026-10-01T00:00:00Z", {"overflow_fraction": 2})
    assert r.status_code == 400, r.text
    assert "overflow_fraction" in r.text
    assert cluster.api("GET", f"/dags/{DAG_ID}/dagRuns/bad-value").status_code == 404


def test_unknown_conf_key_refused_naming_the_key(cluster, first_run):
    """Airflow's REST accepts keys the DAG has no Param for; the DAG's first task refuses them."""
    r = cluster.trigger("unknown-key", "2026-10-02T00:00:00Z", {"max_lenght": 512})
    if r.status_code == 400:
        assert "max_lenght" in r.text
        return
    assert r.status_code == 200, r.text
    assert cluster.wait_run("unknown-key") == "failed"
    first = {t["task_id"]: t for t in cluster.task_instances("unknown-key")}["audit_tokenizer"]
    assert first["state"] == "failed" and first["try_number"] == 1  # refused, not retried
    log = cluster.task_log("unknown-key", "audit_tokenizer", 1)
    assert "max_lenght" in log and "max_length" in log  # the key, and the nearest valid one


def test_rerun_one_dataset_leaves_the_others_untouched(cluster, first_run):
    bucket, prefix = run_prefix(cluster, FIRST)
    before = cluster.etags(bucket, prefix)
    requests_before = cluster.generation_requests()
    chat = [t for t in cluster.task_instances(first_run) if t["task_id"] == "dataset.load_route" and t["rendered_map_index"] == "chat"]
    assert len(chat) == 1
    r = cluster.api("POST", f"/dags/{DAG_ID}/clearTaskInstances", json={
        "dag_run_id": first_run, "task_ids": [["dataset.load_route", chat[0]["map_index"]]],
        "include_downstream": True, "dry_run": False, "only_failed": False})
    assert r.status_code == 200, r.text
    cleared = {(t["task_id"], t.get("rendered_map_index")) for t in r.json()["task_instances"]}
    assert ("dataset.load_route", "code") not in cleared and ("dataset.generate_local", "code") not in cleared
    assert cluster.wait_run(first_run) == "success", cluster.task_states(first_run)
    after = cluster.etags(bucket, prefix)
    assert by_dataset(after, prefix, "code") == by_dataset(before, prefix, "code") != {}
    assert cluster.generation_requests() == requests_before  # the reused stages paid nothing again


@pytest.mark.xfail(strict=False, reason="issue 12, open: on the Celery cluster the backfill's reprocessing "
                   "phase has not passed yet (Airflow's side-effect scheduled run beside the backfill; see docs/dag.md)")
def test_two_date_backfill_then_idempotent_reprocessing(cluster):
    for day in BACKFILL:
        upload(cluster, "chat", day)
    conf = json.dumps({"datasets": ["chat"], "skip_hidden_states": True})
    args = ["backfill", "create", "--dag-id", DAG_ID, "--from-date", f"{BACKFILL[0]}", "--to-date", f"{BACKFILL[-1]}",
            "--dag-run-conf", conf]
    known = {r["dag_run_id"] for r in cluster.runs()}
    cluster.airflow(*args)
    runs = wait_backfill_runs(cluster, known, len(BACKFILL), stop_scheduled=True)
    assert {r["state"] for r in runs} == {"success"}, [cluster.task_states(r["dag_run_id"]) for r in runs]
    assert sorted(r["logical_date"][:10] for r in runs) == [f"{d}" for d in BACKFILL]
    # Airflow 3.3.2 takes the backfill's last run as the DAG's latest automated run, so with
    # catchup=False it schedules today's tick at once (docs/dag.md); the documented recipe marks
    # that run failed. Nothing else may have started beside the backfill.
    others = [r for r in cluster.runs() if r["dag_run_id"] not in known and r["run_type"] != "backfill"]
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert [(r["run_type"], r["logical_date"][:10], r["state"]) for r in others] in ([], [("scheduled", today, "failed")])

    for r in others:  # tasks of the side-effect run that were already running finish first
        wait_tasks_settled(cluster, r["dag_run_id"])

    bucket = config(cluster).storage.bucket
    snapshot = {d: cluster.etags(bucket, run_prefix(cluster, d)[1]) for d in BACKFILL}
    requests_before = cluster.generation_requests()
    known = {r["dag_run_id"] for r in cluster.runs()}
    cluster.airflow(*args, "--reprocess-behavior", "completed")
    again = wait_backfill_runs(cluster, known, len(BACKFILL), reprocess=True)
    assert {r["state"] for r in again} == {"success"}
    assert {d: cluster.etags(bucket, run_prefix(cluster, d)[1]) for d in BACKFILL} == snapshot  # 0 objects changed
    assert cluster.generation_requests() == requests_before  # 0 generation requests


def wait_tasks_settled(cluster, run_id: str, timeout: float = 600) -> None:
    """Until no task instance of `run_id` is queued or running (a run marked failed stops
    scheduling new tasks; the ones already on a worker run to their end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = cluster.task_states(run_id)
        if not any(s in ("queued", "running", "scheduled", "up_for_retry", "restarting", "deferred") for s in states.values()):
            return
        time.sleep(3)
    pytest.fail(f"tasks of {run_id} still active: {cluster.task_states(run_id)}")


def wait_backfill_runs(cluster, known: set[str], n: int, reprocess: bool = False, timeout: float = 900,
                       stop_scheduled: bool = False) -> list[dict]:
    """The backfill's runs once all `n` have finished (a reprocessed date keeps its run id and is
    cleared instead, so then watch every backfill run's state). `stop_scheduled`: mark a
    scheduled run that appears meanwhile failed, as docs/dag.md tells a person to."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while time.monotonic() < deadline:
        cluster.check_alive()
        every = cluster.runs()
        for r in every:
            if stop_scheduled and r["run_type"] == "scheduled" and r["dag_run_id"] not in known and r["state"] in ("queued", "running"):
                patched = cluster.api("PATCH", f"/dags/{DAG_ID}/dagRuns/{r['dag_run_id']}", json={"state": "failed"})
                assert patched.status_code == 200, patched.text
        runs = [r for r in every if r["run_type"] == "backfill" and (reprocess or r["dag_run_id"] not in known)]
        fresh = [r for r in runs if not reprocess or (r["end_date"] or "") > time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started - 1))]
        if len(fresh) >= n and all(r["state"] in ("success", "failed") for r in fresh):
            return fresh
        time.sleep(3)
    pytest.fail(f"backfill runs not finished: {[(r['dag_run_id'], r['state']) for r in runs]}")


def test_sigkill_of_the_generating_worker_is_retried_without_loss_or_duplicates(cluster, killed_run):
    """See the `killed_run` fixture: the gpu worker's whole process group was SIGKILLed once the
    local stage had committed a part; the scheduler found the task without heartbeat and retried
    it on the replacement worker, whose retry resumed from the committed parts."""
    from eagle3_data.storage import StageRef

    store, day = killed_run["store"], killed_run["date"]
    tis = {(t["task_id"], t["rendered_map_index"]): t for t in cluster.task_instances(KILLED_RUN)}
    local = tis["dataset.generate_local", "tool_calls"]
    assert local["state"] == "success" and local["try_number"] >= 2, local
    assert tis["dataset.reconstruct", "tool_calls"]["state"] == "success"
    rows = store.read_table(StageRef(f"date={day}", "generate_local", "tool_calls"), columns=["sample_id"]).column("sample_id").to_pylist()
    routed = store.read_table(StageRef(f"date={day}", "prompts", "tool_calls"))
    want = [sid for sid, route in zip(routed.column("sample_id").to_pylist(), routed.column("route").to_pylist()) if route != "overflow"]
    assert len(rows) == len(set(rows)), "duplicated samples"
    assert set(rows) == set(want), f"lost {len(set(want) - set(rows))} samples"
    # The run failed by its strict gate (the browser test's failed run), not by the kill.
    assert killed_run["state"] == "failed"
    report = store.get_json(StageRef(f"date={day}", "validate", "tool_calls"), "report.json")
    assert not report["gate"]["passed"] and report["counts"]["bpe_only"] > 0


def test_report_view_through_the_api_server_with_auth(cluster, first_run):
    from eagle3_data.config import DAG_ID as dag

    url = f"{cluster.base}/eagle3-report/{dag}/{first_run}"
    assert httpx.get(url, timeout=30).status_code == 401
    forged = cluster.token()[:-4] + ("AAAA" if not cluster.token().endswith("AAAA") else "BBBB")
    assert httpx.get(url, headers={"Authorization": f"Bearer {forged}"}, timeout=30).status_code == 403
    assert httpx.get(url, cookies={"_token": "not-a-jwt"}, timeout=30).status_code == 403
    ok = httpx.get(url, headers={"Authorization": f"Bearer {cluster.token()}"}, timeout=30)
    assert ok.status_code == 200 and "chat" in ok.text and "code" in ok.text
