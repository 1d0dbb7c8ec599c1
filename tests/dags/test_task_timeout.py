"""No task waits forever: a generation task whose engine hangs is killed at its execution_timeout
(sized from its samples and the measured rates, here the config's floor), retried by Airflow,
and the retry resumes from the parts the first attempt committed: nothing paid for is asked
again, and the run completes."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest
from eagle3_airflow import DAG_ID

from eagle3_data.config import load_config
from tests.fixtures.airflow import dag_stack

pytestmark = pytest.mark.slow

DATE = datetime(2026, 9, 1, tzinfo=timezone.utc)
RUN_KEY = "date=2026-09-01"
SAMPLES = 10
ANSWERED_FIRST = 4  # answered (two parts of two rows committed) before the engine hangs
IN_FLIGHT = 2
OVERRIDES = {
    "generation": {
        "sampling": {"max_new_tokens": 48},
        "local": {"rows_per_part": 2, "in_flight_per_endpoint": IN_FLIGHT},
    },
    # the rate the timeout is sized from (no earlier run measured one): 2 in flight / 0.5 s
    "routing": {"overflow_fraction": 0.0, "calibration_samples": 0, "local_latency_s": 0.5},
    "validation": {"max_bpe_mismatch_rate": 1.0},
    "timeouts": {"generation_floor_s": 20, "generation_margin": 1.0},
    "datasets": [{"name": "chat"}],
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, airflow_db):
    with dag_stack(
        tmp_path_factory.mktemp("timeout"), ("chat",), SAMPLES, f"{DATE:%Y-%m-%d}", config_overrides=OVERRIDES
    ) as s:
        yield s


def test_a_hung_generation_task_is_killed_retried_and_resumes(stack):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session

    from eagle3_data.pipeline import open_store
    from eagle3_data.storage import StageRef

    # the engine answers ANSWERED_FIRST requests, then accepts IN_FLIGHT more and never answers them
    r = httpx.post(
        f"{stack.inference_url}/dev/config",
        timeout=10,
        json={"endpoints": {"generate": {"stall_after": ANSWERED_FIRST, "stall_requests": IN_FLIGHT, "stall_s": 3600}}},
    )
    assert r.status_code == 200, r.text
    dag = DagBag(dag_folder=str(__import__("tests.fixtures.airflow", fromlist=["REPO"]).REPO / "dags")).dags[DAG_ID]
    dr = dag.test(logical_date=DATE, run_conf={"skip_hidden_states": True})
    assert str(dr.state).endswith("success")

    with create_session() as session:
        tis = {ti.task_id: ti for ti in dr.get_task_instances(session=session)}
        local = tis["dataset.generate_local"]
        history = (
            session.query(TaskInstanceHistory)
            .filter_by(dag_id=DAG_ID, run_id=dr.run_id, task_id="dataset.generate_local")
            .all()
        )
    assert str(local.state).endswith("success") and local.try_number == 2  # killed once, then retried
    assert [str(h.state) for h in history] == ["failed"] or [str(h.state).split(".")[-1] for h in history] == ["failed"]

    store = open_store(load_config(stack.config_path), stack.client())
    manifest = store.read_manifest(StageRef(RUN_KEY, "generate_local", "chat"))
    assert (
        manifest["rows"] == SAMPLES and manifest["extra"]["counts"]["ok"] == SAMPLES - ANSWERED_FIRST
    )  # this attempt's
    rows = store.read_table(StageRef(RUN_KEY, "generate_local", "chat")).to_pylist()
    assert sorted(r["status"] for r in rows) == ["ok"] * SAMPLES
    assert manifest["extra"]["writer"]["resumed_parts"] == ANSWERED_FIRST // 2  # the first attempt's parts kept
    stats = stack.server_stats()
    assert stats["faults"]["generate"]["stall"] == IN_FLIGHT
    # every sample answered exactly once: the two committed parts were not asked again
    assert sorted(stats["answered"]["generate"].values()) == [1] * SAMPLES
    assert sum(stats["requests"]["generate"].values()) == SAMPLES + IN_FLIGHT
