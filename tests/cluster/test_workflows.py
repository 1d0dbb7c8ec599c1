"""The users' workflows on the Celery cluster, over HTTP as the UI does them, and with the CLIs.

Every run reads its prompts from a date partition put in place by `eagle3-data prompts upload`
(the command a person uses before a backfill); each manual run has its own logical date
(Airflow keeps logical dates unique per DAG). Generation requests are counted by the dev
inference server, objects compared by ETag.
"""

from __future__ import annotations

import json
import time
from datetime import date, datetime, timedelta, timezone

import httpx
import pytest
from eagle3_airflow import DAG_ID, GPU_QUEUE

from tests.cluster.conftest import KILLED_RUN, SMALL, config, run_prefix, upload

FIRST = date(2026, 11, 1)  # the triggered run
GPU_TASKS = {"dataset.generate_local", "dataset.score_policy", "extract_hidden_states"}


def by_dataset(objects: dict[str, str], prefix: str, dataset: str) -> dict[str, str]:
    """Objects of one dataset: runs/{key}/{stage}/{dataset}/..."""
    return {k: v for k, v in objects.items() if k[len(prefix) :].split("/")[1:2] == [dataset]}


@pytest.fixture(scope="module")
def first_run(cluster) -> str:
    for ds in ("chat", "code"):
        upload(cluster, ds, FIRST, rows=SMALL)
    r = cluster.trigger("first", f"{FIRST}T00:00:00Z", {"datasets": ["chat", "code"]})
    assert r.status_code == 200, r.text
    assert cluster.wait_run("first") == "success", cluster.task_states("first")
    return "first"


def test_triggered_run_succeeds_with_gpu_tasks_on_the_gpu_worker(cluster, first_run):
    tis = cluster.task_instances(first_run)
    # every task succeeded but the probe, which skips under the default probe.when auto on a GPU
    # worker without a GPU (this machine's)
    assert {t["task_id"]: t["state"] for t in tis if t["state"] != "success"} == {"probe": "skipped"}, (
        cluster.task_states(first_run)
    )
    probe = next(t for t in tis if t["task_id"] == "probe")
    assert (probe["queue"], probe["hostname"]) == (GPU_QUEUE, "gpu-worker"), probe  # it decided there
    tis = [t for t in tis if t["task_id"] != "probe"]
    placed = {(t["task_id"], t["queue"], t["hostname"]) for t in tis}
    for task_id, queue, host in placed:
        if task_id in GPU_TASKS:
            assert (queue, host) == (GPU_QUEUE, "gpu-worker"), (task_id, queue, host)
        else:
            assert (queue, host) == ("default", "default-worker"), (task_id, queue, host)
    assert {t for t, _, _ in placed} >= GPU_TASKS | {"audit_tokenizer", "dataset.load_route", "publish"}
    for queue in ("default", GPU_QUEUE):  # both workers loaded the tokenizer once for their tasks (celery_config.py)
        log = (cluster.workdir / "logs" / f"worker-{queue}.log").read_text(errors="replace")
        assert "eagle3 worker warm-up: " in log and "warm-up skipped" not in log, log[-2000:]


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
    chat = [
        t
        for t in cluster.task_instances(first_run)
        if t["task_id"] == "dataset.load_route" and t["rendered_map_index"] == "chat"
    ]
    assert len(chat) == 1
    r = cluster.api(
        "POST",
        f"/dags/{DAG_ID}/clearTaskInstances",
        json={
            "dag_run_id": first_run,
            "task_ids": [["dataset.load_route", chat[0]["map_index"]]],
            "include_downstream": True,
            "dry_run": False,
            "only_failed": False,
        },
    )
    assert r.status_code == 200, r.text
    cleared = {(t["task_id"], t.get("rendered_map_index")) for t in r.json()["task_instances"]}
    assert ("dataset.load_route", "code") not in cleared and ("dataset.generate_local", "code") not in cleared
    assert cluster.wait_run(first_run) == "success", cluster.task_states(first_run)
    after = cluster.etags(bucket, prefix)
    assert by_dataset(after, prefix, "code") == by_dataset(before, prefix, "code") != {}
    assert cluster.generation_requests() == requests_before  # the reused stages paid nothing again


def backfill_command(days: tuple[date, date]) -> list[str]:
    """docs/dag.md's (and the README's) backfill command, for `days` and the chat dataset."""
    return [
        "backfill",
        "create",
        "--dag-id",
        DAG_ID,
        "--from-date",
        f"{days[0]}",
        "--to-date",
        f"{days[-1]}",
        "--reprocess-behavior",
        "completed",
        "--max-active-runs",
        "2",
        "--dag-run-conf",
        json.dumps({"datasets": ["chat"], "skip_hidden_states": True}),
    ]


def test_two_date_backfill_then_idempotent_reprocessing(cluster):
    """docs/dag.md's backfill recipe, pasted twice: prompts uploaded for yesterday and today,
    `airflow backfill create` up to today (so Airflow 3.3.2 has no later tick to schedule beside
    the backfill), both runs succeed; the same command again reprocesses both dates (Airflow
    allows it once the first backfill is complete) with 0 objects changed and 0 generation
    requests; and no run other than the backfills' appeared."""
    today = datetime.now(timezone.utc).date()
    days = (today - timedelta(days=1), today)
    for day in days:
        upload(cluster, "chat", day, rows=SMALL)
    known = {r["dag_run_id"] for r in cluster.runs()}
    runs = run_backfill(cluster, backfill_command(days), until_complete=True)
    assert {r["state"] for r in runs} == {"success"}, [cluster.task_states(r["dag_run_id"]) for r in runs]
    assert sorted(r["logical_date"][:10] for r in runs) == [f"{d}" for d in days]

    bucket = config(cluster).storage.bucket
    snapshot = {d: cluster.etags(bucket, run_prefix(cluster, d)[1]) for d in days}
    assert all(snapshot.values()), snapshot
    requests_before = cluster.generation_requests()
    again = run_backfill(cluster, backfill_command(days))  # the same command: accepted once the first is complete
    assert {r["dag_run_id"] for r in again} == {r["dag_run_id"] for r in runs}  # the same runs, cleared and run again
    assert {r["state"] for r in again} == {"success"}, [cluster.task_states(r["dag_run_id"]) for r in again]
    assert {d: cluster.etags(bucket, run_prefix(cluster, d)[1]) for d in days} == snapshot  # 0 objects changed
    assert cluster.generation_requests() == requests_before  # 0 generation requests
    others = [
        (r["run_type"], r["logical_date"], r["state"])
        for r in cluster.runs()
        if r["dag_run_id"] not in known and r["run_type"] != "backfill"
    ]
    assert others == []  # no scheduled run beside the backfill (docs/dag.md, section 3)


def run_backfill(cluster, command: list[str], *, until_complete: bool = False, timeout: float = 900) -> list[dict]:
    """Create a backfill with the CLI; returns its runs once each has ended after the backfill
    was created (a reprocessed date keeps its run, cleared and queued again). `until_complete`:
    also wait until Airflow marks the backfill itself complete, which the scheduler does up to
    30 s after its last run ended; another backfill of the DAG is refused before that."""
    before = {b["id"] for b in backfills(cluster)}
    cluster.airflow(*command)
    [backfill] = [b for b in backfills(cluster) if b["id"] not in before]
    created = datetime.fromisoformat(backfill["created_at"])
    first, last = datetime.fromisoformat(backfill["from_date"]), datetime.fromisoformat(backfill["to_date"])
    deadline = time.monotonic() + timeout
    while True:
        runs = [
            r
            for r in cluster.runs()
            if r["run_type"] == "backfill" and first <= datetime.fromisoformat(r["logical_date"]) <= last
        ]
        ended = runs and all(
            r["state"] in ("success", "failed") and r["end_date"] and datetime.fromisoformat(r["end_date"]) > created
            for r in runs
        )
        if ended and until_complete:
            r = cluster.api("GET", f"/backfills/{backfill['id']}")
            assert r.status_code == 200, r.text
            ended = r.json()["completed_at"] is not None
        if ended:
            return runs
        assert time.monotonic() < deadline, [(r["dag_run_id"], r["state"]) for r in runs]
        cluster.check_alive()
        time.sleep(1)


def backfills(cluster) -> list[dict]:
    r = cluster.api("GET", "/backfills", params={"dag_id": DAG_ID, "limit": 100})
    assert r.status_code == 200, r.text
    return r.json()["backfills"]


def test_sigkill_of_the_generating_worker_is_retried_without_loss_or_duplicates(cluster, killed_run):
    """See the `killed_run` fixture: the gpu worker's whole process group was SIGKILLed once the
    local stage had committed a part; its task runner died with its supervisor (it did not finish
    the stage, nor hold its lease against the retry), the scheduler found the task without heartbeat
    and retried it on the replacement worker, whose retry resumed from the committed parts."""
    from eagle3_data.storage import StageRef

    store, day = killed_run["store"], killed_run["date"]
    tis = {(t["task_id"], t["rendered_map_index"]): t for t in cluster.task_instances(KILLED_RUN)}
    local = tis["dataset.generate_local", "tool_calls"]
    assert local["state"] == "success" and local["try_number"] == 2, local
    manifest = store.read_manifest(StageRef(f"date={day}", "generate_local", "tool_calls"))
    assert manifest["extra"]["writer"]["resumed_parts"] >= 1, manifest["extra"]["writer"]  # the retry's commit
    assert tis["dataset.reconstruct", "tool_calls"]["state"] == "success"
    rows = (
        store.read_table(StageRef(f"date={day}", "generate_local", "tool_calls"), columns=["sample_id"])
        .column("sample_id")
        .to_pylist()
    )
    routed = store.read_table(StageRef(f"date={day}", "prompts", "tool_calls"))
    want = [
        sid
        for sid, route in zip(routed.column("sample_id").to_pylist(), routed.column("route").to_pylist())
        if route != "overflow"
    ]
    assert len(rows) == len(set(rows)), "duplicated samples"
    assert set(rows) == set(want), f"lost {len(set(want) - set(rows))} samples"
    # The run failed by its strict gate (the browser test's failed run), not by the kill.
    assert killed_run["state"] == "failed"
    report = store.get_json(StageRef(f"date={day}", "validate", "tool_calls"), "report.json")
    assert not report["gate"]["passed"] and report["counts"]["bpe_only"] > 0


def test_report_view_through_the_api_server_with_auth(cluster, first_run):
    from eagle3_airflow import DAG_ID as dag

    url = f"{cluster.base}/eagle3-report/{dag}/{first_run}"
    assert httpx.get(url, timeout=30).status_code == 401
    forged = cluster.token()[:-4] + ("AAAA" if not cluster.token().endswith("AAAA") else "BBBB")
    assert httpx.get(url, headers={"Authorization": f"Bearer {forged}"}, timeout=30).status_code == 403
    assert httpx.get(url, cookies={"_token": "not-a-jwt"}, timeout=30).status_code == 403
    ok = httpx.get(url, headers={"Authorization": f"Bearer {cluster.token()}"}, timeout=30)
    assert ok.status_code == 200 and "chat" in ok.text and "code" in ok.text
