"""The real DAG end to end: `dag.test()` against SeaweedFS, the dev inference server and the tiny
Kimi-K2.5 (the packaged default target), with small samples. One module-scoped stack; the tests
run in file order and build on each other's run (full run -> clear-rerun of one dataset ->
idempotent rerun -> form rerun).

`chat` gets a dev-server BPE split rate far above its gate threshold, so it fails its gate while
the other datasets complete; the clear-rerun then raises its threshold in the config file.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from eagle3_airflow import DAG_ID

from eagle3_data.config import load_config
from tests.conversation_oracle import CONVERSATIONS, check_conversation_records, check_spliced_results, stage_rows
from tests.fixtures.airflow import DAG_TEST_BUCKET, dag_stack

pytestmark = pytest.mark.slow

DATE = datetime(2026, 11, 1, tzinfo=timezone.utc)
RUN_KEY = "date=2026-11-01"
SAMPLES = 5  # prompts per dataset
MAX_NEW = 200  # long enough that the dev model finishes (a cut tool call cannot be reconstructed)
PER_DATASET_STAGES = ("prompts", "generate_local", "generate_overflow", "reconstruct", "validate")
OVERRIDES = {
    "generation": {
        "sampling": {"max_new_tokens": MAX_NEW},
        "local": {"rows_per_part": 2},
        "overflow": {"rows_per_part": 2},
    },
    "routing": {"overflow_fraction": 0.4, "calibration_samples": 1},
    "merge": {"max_length": 512, "shard_tokens": 1024},
    "hidden_states": {"workers": 2},  # two GPU-worker tasks, each loading the model once for its shards
    # the probe's size when a run turns it on (param probe=always; the default auto skips it on a CPU)
    "probe": {"samples": 12, "eval_samples": 4, "max_len": 512, "eval_every": 2},
    "datasets": [
        {"name": "tool_calls"},
        {"name": "code"},
        {"name": "chat", "dev": {"bpe_split_rate": 0.9}, "validation": {"max_bpe_mismatch_rate": 0.10}},
    ],
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, airflow_db):
    global _EVENTS_BEFORE
    _EVENTS_BEFORE = _last_asset_event_id()  # another module's runs of the DAG (tests/engine) are not this story's
    with dag_stack(
        tmp_path_factory.mktemp("e2e"),
        ("tool_calls", "code", "chat"),
        SAMPLES,
        f"{DATE:%Y-%m-%d}",
        config_overrides=OVERRIDES,
    ) as s:
        yield s


@pytest.fixture
def dag(stack):
    """Parsed per test, as the dag-processor would: dag.test() in one process mutates Param defaults."""
    from airflow.dag_processing.dagbag import DagBag

    from tests.fixtures.airflow import REPO

    return DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]


def _store(stack):
    from eagle3_data.pipeline import open_store

    return open_store(load_config(stack.config_path), stack.client())


def _states(dag_run) -> dict[tuple[str, str], str]:
    from airflow.utils.session import create_session

    with create_session() as session:
        return {
            (ti.task_id, ti.rendered_map_index or str(ti.map_index)): str(ti.state)
            for ti in dag_run.get_task_instances(session=session)
        }


def _objects(stack, dataset: str | None = None) -> dict[str, tuple[str, int, str]]:
    """Every object of the run (or of one dataset's stages): key -> (ETag, size, LastModified)."""
    client, out = stack.client(), {}
    prefix = f"eagle3-datagen/runs/{RUN_KEY}/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=DAG_TEST_BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            parts = o["Key"][len(prefix) :].split("/")
            if dataset is None or (parts[0] in PER_DATASET_STAGES and parts[1] == dataset):
                out[o["Key"]] = (o["ETag"], o["Size"], o["LastModified"].isoformat())
    return out


def _manifest_hashes(stack) -> dict[str, str]:
    client = stack.client()
    return {
        k: json.loads(client.get_object(Bucket=DAG_TEST_BUCKET, Key=k)["Body"].read())["manifest_sha256"]
        for k in _objects(stack)
        if k.endswith("/_manifest.json")
    }


def _resume(dag, run_id: str) -> None:
    """The scheduling loop of `dag.test()` on an existing run (after clearing some of its tasks)."""
    from airflow.models.dagrun import DagRun
    from airflow.sdk import DagRunState, TaskInstanceState, timezone
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter_by(dag_id=dag.dag_id, run_id=run_id).one()
        dr.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        dr.state = DagRunState.RUNNING
        session.commit()
        while dr.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
                ti.scheduled_dttm = timezone.utcnow()
            session.commit()
            for ti in [t for t in dr.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id])


def _clear(dag, run_id: str, task_id: str, map_index: int) -> list[str]:
    """What POST /api/v2/dags/{id}/clearTaskInstances does for task_ids=[[task, map_index]] with
    include_downstream: the same two calls, on the same serialized DAG."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import clear_task_instances, find_relevant_relatives
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session

    sdag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    with create_session() as session:
        relatives = find_relevant_relatives(
            [], [(task_id, map_index)], direction="downstream", dag=sdag, run_id=run_id, session=session
        )
        markers = [(task_id, map_index), *relatives]
        tis = sdag.clear(dry_run=True, task_ids=markers, run_id=run_id, session=session)
        clear_task_instances(list(tis), session, dag_run_state=False)
        session.commit()
        assert session.query(DagRun).filter_by(run_id=run_id).one()
        return sorted(f"{ti.task_id}[{ti.map_index}]" for ti in tis)


# -- 1. full run: every stage's artifacts; one failing gate does not stop the others ----------
def test_full_run_one_gate_fails_others_complete(stack, dag):
    dr = dag.test(logical_date=DATE)
    states = _states(dr)
    store = _store(stack)
    from eagle3_data.storage import StageRef

    for ds in ("tool_calls", "code"):
        assert states[("dataset.validate", ds)] == "success"
        for stage in PER_DATASET_STAGES:
            m = store.read_manifest(StageRef(RUN_KEY, stage, ds))
            assert m["parts"] or m["files"], (stage, ds)
    # the default sampling has a nucleus (top_p 0.95): the DAG's score_policy counts it from the engine's
    # top-K (no target in memory) and the gate runs the nucleus test
    policy = store.get_json(StageRef(RUN_KEY, "validate", "code"), "report.json")["policy"]
    nucleus = policy["figures"]["nucleus"]
    assert all(nucleus[side]["tokens"] > 0 for side in ("local", "overflow")), nucleus
    assert "nucleus" in policy["decision"]["tests"] and policy["passed"], policy
    assert states[("dataset.validate", "chat")] == "failed"
    report = store.get_json(StageRef(RUN_KEY, "validate", "chat"), "report.json")
    assert not report["run_gate"]["passed"]
    assert any("bpe_only rate" in r for r in report["run_gate"]["reasons"]), report["run_gate"]
    calibration = report["calibration"]  # the one sample routed "both": split ids, same text
    assert calibration["samples"] == 1 and calibration["missing"] == [] and calibration["text_disagreements"] == [], (
        calibration
    )
    merged = store.read_manifest(StageRef(RUN_KEY, "merge", "all"))
    assert sorted(merged["extra"]["datasets"]) == ["code", "tool_calls"]
    hs = store.read_manifest(StageRef(RUN_KEY, "hidden_states", "all"))
    assert hs["extra"]["totals"]["samples"] == merged["extra"]["totals"]["samples"] > 0
    assert any(f["name"].endswith(".safetensors") for f in hs["files"])
    # the states are the packaged default target's (dev:tiny-kimi-k25): Kimi-K2.5's own class, loaded
    # by the transformers backend, not the text-only DeepSeek-V3 that stood in before
    target = Path(hs["params"]["model"])
    assert json.loads((target / "config.json").read_text())["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert hs["extra"]["model"] == target.name and target.name.startswith("tiny-kimi-k25-"), hs["extra"]
    assert hs["extra"]["backend"] == "transformers" and hs["extra"]["totals"]["left_out_image_samples"] == 0
    n_shards = len([f for f in merged["files"] if f["name"].endswith(".parquet")])
    extract = [v for (task, _), v in states.items() if task == "extract_hidden_states"]
    assert extract == ["success"] * min(2, n_shards), states  # one task per GPU worker, not per shard
    assert states[("probe", "-1")] == "skipped"  # probe.when auto, and this worker has no GPU
    from eagle3_data.report import RUN_REPORT_NAME, run_report_ref

    not_run = store.get_json(run_report_ref(RUN_KEY), RUN_REPORT_NAME)["training"]["probe_not_run"]
    assert "probe.when auto runs it on a worker with a GPU" in not_run  # the report says why there is no verdict
    assert states[("publish", "-1")] == "failed"  # the run ends failed: nobody trains on it unnoticed
    assert str(dr.state).endswith("failed")
    summary = store.get_json(StageRef(RUN_KEY, "publish", "all"), "summary.json")
    assert summary["datasets"]["chat"]["gate"]["passed"] is False
    assert _asset_events() == []  # a failed run announces nothing to training DAGs
    assert summary["datasets"]["tool_calls"]["overflow"]["cost_usd"] > 0


# -- 2. chat's committed gate replaced on purpose: only chat reruns ------------------------------
def test_clear_one_dataset_reruns_only_it(stack, dag):
    """With chat's thresholds changed in the config, clearing its mapped validate + downstream does
    not replace the committed (failed) gate silently: validate refuses, naming the change and the
    fresh_stages that would replace it, and no dataset's object changes. The trigger form's
    fresh_stages (validate, and merge and hidden states, built from the two datasets that passed)
    then reruns chat alone; the others' artifacts and chat's paid answers stay byte-identical."""
    before = {ds: _objects(stack, ds) for ds in ("tool_calls", "code", "chat")}
    raw = yaml.safe_load(Path(stack.config_path).read_text())
    # accept chat's BPE splits (they also show in its overflow rows as billed > reconstructed)
    raw["datasets"][2]["validation"].update(max_bpe_mismatch_rate=1.0, max_billing_deviation=1.0)
    Path(stack.config_path).write_text(yaml.safe_dump(raw, sort_keys=False))
    run_id = _latest_run_id(dag)
    chat_index = ["tool_calls", "code", "chat"].index("chat")
    cleared = _clear(dag, run_id, "dataset.validate", chat_index)
    assert f"dataset.validate[{chat_index}]" in cleared and "dataset.validate[0]" not in cleared
    _resume(dag, run_id)
    assert _states(_run(run_id))[("dataset.validate", "chat")] == "failed"
    for ds in ("tool_calls", "code", "chat"):
        assert _objects(stack, ds) == before[ds], f"{ds} artifacts changed by a refused rerun"
    conf = {"datasets": ["chat"], "fresh_stages": ["validate", "merge", "hidden_states"]}
    dr = dag.test(logical_date=DATE, run_conf=conf)
    assert str(dr.state).endswith("success"), _states(dr)
    for ds in ("tool_calls", "code"):
        assert _objects(stack, ds) == before[ds], f"{ds} artifacts changed"
    after = _objects(stack, "chat")
    gen = {k: v for k, v in before["chat"].items() if "/generate_local/" in k or "/generate_overflow/" in k}
    assert gen and all(after[k] == v for k, v in gen.items())  # paid work reused
    assert any(after.get(k) != v for k, v in before["chat"].items() if "/validate/" in k)
    events = _asset_events()
    assert (
        len(events) == 1 and events[0]["run_key"] == RUN_KEY and events[0]["datasets"] == ["tool_calls", "code", "chat"]
    )
    # a run on stand-ins says so: in the event training DAGs read, in every manifest, in the report
    stand_ins = ["tokenizer", "model", "local_engine", "overflow_provider"]
    assert events[0]["stand_ins"] == stand_ins
    store = _store(stack)
    from eagle3_data.storage import StageRef

    assert store.read_manifest(StageRef(RUN_KEY, "validate", "chat"))["stand_ins"] == stand_ins
    from eagle3_data.report import RUN_REPORT_NAME, run_report_ref

    index = store.get_json(run_report_ref(RUN_KEY), RUN_REPORT_NAME)
    assert index["stand_ins"] == stand_ins
    # the training data as a whole: the draft vocabulary's coverage and the states' bytes, estimated and written
    training = index["training"]
    merged = store.read_manifest(StageRef(RUN_KEY, "merge", "all"))["extra"]
    assert training["draft_vocab"] == merged["draft_vocab"] and 0 < training["draft_vocab"]["coverage"] <= 1
    est = training["hidden_states_estimate"]
    assert est["tokens"] == merged["totals"]["tokens"] and est["hidden_size"] == 64
    written = store.read_manifest(StageRef(RUN_KEY, "hidden_states", "all"))["extra"]["totals"]["bytes"]
    assert training["hidden_states_bytes"] == written
    assert 0.8 < written / est["bytes"]["shards_bf16"] < 1.25  # the estimate is the layout's own arithmetic
    # every trained token scored by the target, per path; the dev server's answers are not the
    # target's, so the extraction's self-check names them as not compared rather than passing them
    lp, check = training["logprobs"], training["logprob_check"]
    assert lp["trained_tokens"] == sum(s["trained_tokens"] for s in lp["sources"].values()) > 0
    assert {"sglang", "openrouter"} <= set(lp["sources"])
    assert check["compared_samples"] == 0 and check["not_compared"]["stand_in_engine"] > 0
    assert lp["trained_tokens"] == merged["totals"]["loss_tokens"]  # every merged trained token has its log-probability
    from eagle3_data.report import load_run_report, render_html

    html = render_html(load_run_report(store, RUN_KEY), title="t")
    assert "Target log-probabilities of the trained tokens" in html
    # the report states the policy check's power: per dataset (the scored check) and on every row
    power = re.search(r"<b>The policy check in sentences:</b> ([^<]*)</p>", html)
    assert power and "Nucleus test: " in power[1] and "The sampled answers test (" in power[1], html  # top_p
    assert any(n.startswith("policy power: sampled answers") for n in training["policy_every_row"]["notes"])


# -- 3. backfill / rerun of the same date: same keys, same manifests ---------------------------
def test_rerun_same_date_is_idempotent(stack, dag):
    keys_before, hashes_before, events_before = set(_objects(stack)), _manifest_hashes(stack), _asset_events()
    dr = dag.test(logical_date=DATE)
    assert str(dr.state).endswith("success"), _states(dr)
    assert set(_objects(stack)) == keys_before
    assert _manifest_hashes(stack) == hashes_before
    # the same result is announced once: publish skips, no second Asset event for training DAGs
    assert _states(dr)[("publish", "-1")] == "skipped"
    assert _asset_events() == events_before


def test_clear_of_a_successful_run_reuses_everything(stack, dag):
    """Clearing one dataset's load_route + downstream in a run that succeeded: every stage is
    reused (hidden states included), nothing changes, and publish announces nothing new."""
    keys_before, hashes_before, events_before = set(_objects(stack)), _manifest_hashes(stack), _asset_events()
    run_id = _latest_run_id(dag)
    _clear(dag, run_id, "dataset.load_route", ["tool_calls", "code", "chat"].index("chat"))
    _resume(dag, run_id)
    dr = _run(run_id)
    assert str(dr.state).endswith("success"), _states(dr)
    assert _states(dr)[("publish", "-1")] == "skipped"
    assert set(_objects(stack)) == keys_before and _manifest_hashes(stack) == hashes_before
    assert _asset_events() == events_before


# -- 4. trigger-form rerun of one dataset: datasets=[chat], with the probe on -----------------------
def test_form_rerun_of_one_dataset_with_the_probe_on(stack, dag):
    """The form reruns chat alone (the others' artifacts untouched) with its thresholds, and turns
    the probe on (param probe=always; the default auto skipped it on this worker without a GPU):
    speculators' head trained on the new extraction, its simulated acceptance and learning curve
    in the run report."""
    from eagle3_data.report import RUN_REPORT_NAME, load_run_report, render_html, run_report_ref
    from eagle3_data.storage import StageRef

    before = {ds: _objects(stack, ds) for ds in ("tool_calls", "code")}
    conf = {"datasets": ["chat"], "max_bpe_mismatch_rate": 1.0, "max_billing_deviation": 0.999}
    # another threshold than chat's committed gate: replaced by name (the merge, built from the
    # generations, not from the gate, is reused)
    dr = dag.test(
        logical_date=DATE, run_conf={**conf, "probe": "always", "probe_steps": 4, "fresh_stages": ["validate"]}
    )
    states = _states(dr)
    assert str(dr.state).endswith("success"), states
    assert {name for (tid, name) in states if tid == "dataset.validate"} == {"chat"}
    for ds in ("tool_calls", "code"):
        assert _objects(stack, ds) == before[ds]
    store = _store(stack)
    assert (
        store.read_manifest(StageRef(RUN_KEY, "validate", "chat"))["params"]["thresholds"]["max_billing_deviation"]
        == 0.999
    )
    assert sorted(store.read_manifest(StageRef(RUN_KEY, "merge", "all"))["extra"]["datasets"]) == [
        "chat",
        "code",
        "tool_calls",
    ]
    assert states[("probe", "-1")] == "success", states
    probe_ref = StageRef(RUN_KEY, "probe", "all")
    hs = store.read_manifest(StageRef(RUN_KEY, "hidden_states", "all"))
    assert [i["uri"] for i in store.read_manifest(probe_ref)["inputs"]] == [hs["uri"]]  # this run's extraction
    report = store.get_json(probe_ref, "probe.json")
    assert report["config"]["steps"] == 4 and [c["step"] for c in report["curve"]] == [0, 2, 4]
    probe = store.get_json(run_report_ref(RUN_KEY), RUN_REPORT_NAME)["training"]["probe"]
    assert probe["simulated_acceptance"] == report["simulated_acceptance"] and probe["curve"] == report["curve"]
    html = render_html(load_run_report(store, RUN_KEY), title="t")
    assert "The drafter's verdict" in html and "class='probe-curve'" in html
    assert f"<b>{report['simulated_acceptance']:.2f}</b> tokens per step" in html


# -- 5. wrong special-token expectation: fails at the audit, before any request -------------------
def test_wrong_special_id_fails_before_any_request(stack, dag, tmp_path):
    raw = yaml.safe_load(Path(stack.config_path).read_text())
    raw["tokenizer"].setdefault("expected_special_ids", {})["<|im_end|>"] = 163533  # "chas"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    requests_before = stack.server_stats()["requests"]
    os.environ["EAGLE3_CONFIG"] = str(bad)
    try:
        dr = dag.test(logical_date=datetime(2026, 10, 2, tzinfo=timezone.utc), run_conf={"run_name": "bad-audit"})
    finally:
        os.environ["EAGLE3_CONFIG"] = str(stack.config_path)
    states = _states(dr)
    assert states[("audit_tokenizer", "-1")] == "failed"
    # merge and publish run on all_done and fail naming the audit; everything else never started
    assert states[("merge", "-1")] == "failed" and states[("publish", "-1")] == "failed"
    assert all(
        s in ("upstream_failed", "skipped")
        for (tid, _), s in states.items()
        if tid not in ("audit_tokenizer", "merge", "publish")
    ), states
    assert stack.server_stats()["requests"] == requests_before
    report = _store(stack).get_json(
        __import__("eagle3_data.storage", fromlist=["StageRef"]).StageRef("bad-audit", "audit", "tokenizer"),
        "report.json",
    )
    assert any("163533" in p and "chas" in p for p in report["problems"]), report["problems"]


# -- 6. params: invalid values refused; dry run spends nothing -----------------------------------
def test_invalid_params_refused(dag):
    """The same check the api-server runs on a trigger (SerializedDAG.create_dagrun), and dag.test."""
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.serialization.serialized_objects import DagSerialization

    params = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params
    bad_confs = (
        {"overflow_fraction": 1.5},
        {"datasets": ["nope"]},
        {"layer_convention": "middle"},
        {"max_usd": -1},
        {"run_name": "a/b"},
        {"max_bpe_mismatch_rate": 2},
        {"dry_run": "yes"},
    )
    for bad in bad_confs:
        with pytest.raises(ParamValidationError):
            params.deep_merge(bad).validate()
    assert params.deep_merge({"overflow_fraction": 0.5}).validate()["overflow_fraction"] == 0.5
    with pytest.raises(ParamValidationError, match="overflow_fraction"):
        dag.test(logical_date=datetime(2026, 10, 1, tzinfo=timezone.utc), run_conf={"overflow_fraction": 7})


def _first_task_failure(dr, capfd) -> str:
    """What the run printed (dag.test runs tasks in-process), after checking that only the first
    task ran and failed."""
    states = _states(dr)
    assert states[("audit_tokenizer", "-1")] == "failed", states
    assert all(s in ("upstream_failed", "skipped", "failed") for s in states.values()), states
    out = capfd.readouterr()
    return out.out + out.err


def test_unknown_conf_key_fails_the_first_task_naming_it(stack, dag, capfd):
    """Airflow accepts unknown conf keys at trigger time (3.3 has no hook to refuse them); the
    first task refuses them, naming the key and the nearest param, before any request."""
    requests_before = stack.server_stats()["requests"]
    dr = dag.test(logical_date=datetime(2026, 10, 3, tzinfo=timezone.utc), run_conf={"max_bpe_mismatch_rat": 0.5})
    log = _first_task_failure(dr, capfd)
    assert "params.max_bpe_mismatch_rat: unknown param (did you mean max_bpe_mismatch_rate?)" in log, log[-3000:]
    assert stack.server_stats()["requests"] == requests_before


def test_run_without_logical_date_reads_the_newest_partition_and_says_so(stack, dag, caplog):
    """A manual trigger (the REST API's default `logical_date: null`) of a deployment whose prompts
    are date partitions reads each dataset's newest partition, and the first task says which. A
    dry run: the plan records each dataset's date, nothing is sent."""
    from eagle3_data.storage import StageRef

    bucket, _, prefix = load_config(stack.config_path).dataset("chat").prompts.removeprefix("s3://").partition("/")
    newer = "".join(json.dumps({"messages": [{"role": "user", "content": f"newer {i}"}]}) + "\n" for i in range(2))
    stack.client().put_object(
        Bucket=bucket, Key=f"{prefix.rstrip('/')}/chat/date=2026-11-02/chat.jsonl", Body=newer.encode()
    )
    requests_before = stack.server_stats()["requests"]
    dr = dag.test(logical_date=None, run_conf={"run_name": "undated", "dry_run": True, "datasets": ["chat", "code"]})
    assert str(dr.state).endswith("success"), _states(dr)
    plans = _store(stack).get_json(StageRef("undated", "plan", "all"), "plan.json")["datasets"]
    assert (plans["chat"]["date"], plans["chat"]["counts"]["prompts"]) == ("2026-11-02", 2)  # chat's newest, 2 rows
    assert plans["code"]["date"] == f"{DATE:%Y-%m-%d}"
    assert "dataset chat: a run without a logical date reads the newest date partition of s3://" in caplog.text
    assert stack.server_stats()["requests"] == requests_before


def test_dry_run_plans_without_spend(stack, dag):
    requests_before = stack.server_stats()["requests"]
    dr = dag.test(logical_date=DATE, run_conf={"dry_run": True, "run_name": "plan-only"})
    assert str(dr.state).endswith("success"), _states(dr)
    assert stack.server_stats()["requests"] == requests_before
    from eagle3_data.storage import StageRef

    plan = _store(stack).get_json(StageRef("plan-only", "plan", "all"), "plan.json")
    assert set(plan["datasets"]) == {"tool_calls", "code", "chat"}
    assert (
        plan["totals"]["prompt_tokens"] > 0
        and plan["totals"]["max_output_tokens"] == 3 * SAMPLES * MAX_NEW + 3 * MAX_NEW
    )
    # every routing strategy's expected wall time and cost, for the run and for each dataset
    assert set(plan["strategies"]) == {"fraction", "capacity", "balanced"}
    assert all(set(p["estimate"]["strategies"]) == set(plan["strategies"]) for p in plan["datasets"].values())
    assert plan["strategies"]["balanced"]["wall_s"] <= plan["strategies"]["fraction"]["wall_s"]
    # the run's figures (issue 57): storage per dtype, extraction GPU hours; the report tab's page reads it
    assert (
        set(plan["storage"]["dtypes"]) == {"bf16", "fp8", "ids-only"} and plan["extraction"]["gpu_hours"]["upper"] > 0
    )
    from eagle3_data.report.plan_view import load_plan

    assert load_plan(_store(stack), "plan-only")[1] == plan


# -- 7. the mode is bound once: a run with thinking off; a server stopping on the wrong id --------
def _with_config(stack, tmp_path, mutate) -> Path:
    raw = yaml.safe_load(Path(stack.config_path).read_text())
    mutate(raw)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_thinking_off_run_passes_without_think_tokens(stack, dag, tmp_path):
    """generation.sampling.thinking: false reaches every stage through the one bound format: no
    reconstructed overflow row holds </think> (163607), and the gates pass."""
    path = _with_config(stack, tmp_path, lambda raw: raw["generation"]["sampling"].update(thinking=False))
    os.environ["EAGLE3_CONFIG"] = str(path)
    try:
        dr = dag.test(
            logical_date=DATE, run_conf={"run_name": "no-think", "datasets": ["code"], "skip_hidden_states": True}
        )
    finally:
        os.environ["EAGLE3_CONFIG"] = str(stack.config_path)
    states = _states(dr)
    assert str(dr.state).endswith("success"), states
    from eagle3_data.storage import StageRef

    store = _store(stack)
    rebuilt = [r for b in store.iter_batches(StageRef("no-think", "reconstruct", "code")) for r in b.to_pylist()]
    assert [r for r in rebuilt if r["status"] == "ok"], rebuilt
    assert all(163607 not in (r["output_ids"] or []) for r in rebuilt)
    assert store.read_manifest(StageRef("no-think", "validate", "code"))["extra"]["gate"]["passed"]


def test_server_stopping_on_the_wrong_id_fails_the_gate_naming_it(stack, dag):
    """A misconfigured engine that ends every answer with 163533 ("chas") instead of <|im_end|>."""
    import httpx

    rates = {d.name: {"noncanonical_rate": d.dev_bpe_split_rate} for d in load_config(stack.config_path).datasets}
    httpx.post(
        f"{stack.inference_url}/dev/config", json={"stop_id_override": 163533, "datasets": rates}, timeout=30
    ).raise_for_status()
    try:
        dr = dag.test(
            logical_date=DATE, run_conf={"run_name": "wrong-stop", "datasets": ["code"], "skip_hidden_states": True}
        )
    finally:
        httpx.post(f"{stack.inference_url}/dev/config", json={"datasets": rates}, timeout=30).raise_for_status()
    assert _states(dr)[("dataset.validate", "code")] == "failed"
    from eagle3_data.storage import StageRef

    report = _store(stack).get_json(StageRef("wrong-stop", "validate", "code"), "report.json")
    assert not report["run_gate"]["passed"]
    assert any("163533" in r for r in report["run_gate"]["reasons"]), report["run_gate"]
    # its only dataset failed, so merge failed too; publish still wrote the run report (the UI tab's index)
    from eagle3_data.report import run_report_ref

    assert _states(dr)[("merge", "-1")] == "failed" and _states(dr)[("publish", "-1")] == "failed"
    assert _store(stack).is_complete(run_report_ref("wrong-stop"))


_EVENTS_BEFORE = 0  # the last Asset event id before this module's first run


def _training_data_events(session):
    """The `eagle3_training_data` Asset events, oldest first."""
    from airflow.models.asset import AssetEvent, AssetModel

    return (
        session.query(AssetEvent)
        .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
        .filter(AssetModel.name == "eagle3_training_data")
        .order_by(AssetEvent.id)
    )


def _last_asset_event_id() -> int:
    from airflow.utils.session import create_session

    with create_session() as session:
        return max((e.id for e in _training_data_events(session)), default=0)


def _asset_events() -> list[dict]:
    """Extras of the Asset events that this module's runs recorded so far."""
    from airflow.utils.session import create_session

    with create_session() as session:
        return [dict(e.extra or {}) for e in _training_data_events(session) if e.id > _EVENTS_BEFORE]


def _latest_run_id(dag) -> str:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        return session.query(DagRun).filter_by(dag_id=dag.dag_id).order_by(DagRun.id.desc()).first().run_id


def _run(run_id: str):
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter_by(run_id=run_id).one()
        session.expunge(dr)
        return dr


def test_image_prompts_run_through_the_dag(stack, tmp_path, kimi_tokenizer, vllm_python):
    """include/sample_data/images.jsonl (every image layout) through the whole DAG on the dev
    server: each sample's prompt ids are what transformers' Kimi-K2.5 processor makes of its
    messages and images (tests/image_oracle.py), on both paths; in the merge the media tokens are
    never trained on and the references sit beside the shards; the report counts them; and with
    `hidden_states.max_images` the transformers backend extracts every image sample, its states
    equal to transformers' own forward of the tiny Kimi-K2.5 given vLLM's processor's pixels."""
    import io

    import pyarrow.parquet as pq

    from eagle3_data.images import read_image, read_merged_images
    from eagle3_data.report import load_run_report
    from eagle3_data.storage import StageRef
    from eagle3_devtools.stack import SAMPLE_DATA, upload_prompts
    from tests.image_oracle import processor_ids

    path = _with_config(
        stack,
        tmp_path,
        lambda raw: (
            raw["datasets"].append({"name": "images", "validation": {"allow_unvalidated_overflow": True}}),
            raw["hidden_states"].update(max_images=2),
        ),
    )  # no local answers (generation.local.images is false): docs/images.md
    upload_prompts(stack.client(), load_config(path), f"{DATE:%Y-%m-%d}", {"images": SAMPLE_DATA / "images.jsonl"})
    os.environ["EAGLE3_CONFIG"] = str(path)
    try:
        from airflow.dag_processing.dagbag import DagBag

        from tests.fixtures.airflow import REPO

        dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]  # parsed with the dataset in its form
        dr = dag.test(logical_date=DATE, run_conf={"run_name": "images", "datasets": ["images"]})
    finally:
        os.environ["EAGLE3_CONFIG"] = str(stack.config_path)
    assert str(dr.state).endswith("success"), _states(dr)
    store = _store(stack)
    pad = kimi_tokenizer.convert_tokens_to_ids("<|media_pad|>")
    rows = [
        r for stage in ("generate_local", "reconstruct") for r in stage_rows(store, "images", stage, "images").values()
    ]
    sources = Counter()
    for row in rows:
        assert row["status"] == "ok", row
        refs = json.loads(row["images"])
        assert refs and all(len(read_image(store, r)) == r["bytes"] for r in refs)  # stored, and as recorded
        expected = processor_ids(kimi_tokenizer, json.loads(row["messages"]), [(r["width"], r["height"]) for r in refs])
        assert list(row["prompt_ids"]) == expected, row["sample_id"]
        sources[row["source"]] += 1
    # image prompts go to the overflow path whatever the routing (generation.local.images is false)
    assert set(sources) == {"openrouter"} and sources["openrouter"] == 4, sources
    # the policy check scores ids only: an answer to an image it is not shown is never scored
    policy = store.get_json(StageRef("images", "score_policy", "images"), "policy.json")
    assert policy["image_samples_left_out"] == {"local": 0, "overflow": 4}, policy
    assert policy["skipped"] == "no overflow answers to text prompts (4 to image prompts left out)", policy
    prompts = store.read_manifest(StageRef("images", "prompts", "images"))["extra"]["counts"]
    assert prompts["overflow"] == 4 and prompts["images_to_overflow"] > 0 and "local" not in prompts, prompts
    merge = StageRef("images", "merge", "all")
    images = read_merged_images(store, merge)
    records = [
        r
        for s in store.read_manifest(merge)["extra"]["shards"]
        for r in pq.read_table(io.BytesIO(store.read_object(merge, s["name"]))).to_pylist()
    ]
    assert records and {r["sample_id"] for r in records} <= set(images)
    for r in records:
        pads = [k for k, t in enumerate(r["input_ids"]) if t == pad]
        assert len(pads) == sum(i["media_tokens"] for i in images[r["sample_id"]]) > 0
        assert all(r["loss_mask"][k] == 0 for k in pads) and max(pads) < r["prompt_tokens"]
    entry = next(d for d in load_run_report(store, "images").datasets if d.name == "images")
    assert entry.generation["images"]["image_rows"] == 4 and entry.generation["images"]["media_tokens"] > 0

    # extraction: the transformers backend (pixels.py) over every image sample, none left out
    from eagle3_data.exports.shards import ShardReader
    from tests.image_oracle import check_image_sample_states

    hs_ref = StageRef("images", "hidden_states", "all")
    hs = store.read_manifest(hs_ref)
    assert hs["extra"]["backend"] == "transformers" and hs["extra"]["totals"]["left_out_image_samples"] == 0
    stored, layer_ids = {}, set()
    for f in hs["files"]:
        if f["name"].endswith(".safetensors"):
            reader = ShardReader(store.get_file(hs_ref, f["name"], tmp_path / f["name"]))
            assert reader.convention == "output"  # layer L's output is transformers' hidden_states[L + 1]
            layer_ids.add(tuple(json.loads(reader.metadata["layer_ids"])))
            stored.update({s.sample_id: s for s in reader})
    (layers,) = layer_ids
    hs_indices = [layer + 1 for layer in layers]
    by_id = {r["sample_id"]: r for r in records}
    assert set(stored) == set(by_id)
    check_image_sample_states(
        store, vllm_python, Path(hs["params"]["model"]), by_id, images, stored, hs_indices, tmp_path
    )


@pytest.mark.parametrize(
    "mode,history", [("final_turn", "dataset"), ("every_turn", "regenerated"), ("trajectory", "dataset")]
)
def test_conversations_run_through_the_dag_in_every_mode(mode, history, stack, tmp_path, kimi_tokenizer):
    """include/sample_data/conversations.jsonl through the whole DAG (local and overflow, gates,
    merge) with the run's `regenerate` and `history` params: every merged record equals the
    template's render at each of its turns, loss mask 1 exactly on the generated tokens."""
    from eagle3_devtools.stack import upload_prompts

    path = _with_config(stack, tmp_path, lambda raw: raw["datasets"].append({"name": "conversations"}))
    upload_prompts(stack.client(), load_config(path), f"{DATE:%Y-%m-%d}", {"conversations": CONVERSATIONS})
    run_name = f"conv-{mode}-{history}".replace("_", "-")
    os.environ["EAGLE3_CONFIG"] = str(path)
    try:
        from airflow.dag_processing.dagbag import DagBag

        from tests.fixtures.airflow import REPO

        dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]  # parsed with the dataset in its form
        dr = dag.test(
            logical_date=DATE,
            run_conf={
                "run_name": run_name,
                "datasets": ["conversations"],
                "regenerate": mode,
                "history": history,
                "skip_hidden_states": mode != "trajectory",
            },
        )
    finally:
        os.environ["EAGLE3_CONFIG"] = str(stack.config_path)
    states = _states(dr)
    assert str(dr.state).endswith("success"), states
    store = _store(stack)
    counts = check_conversation_records(store, run_name, "conversations", kimi_tokenizer)
    assert counts.get("sglang") and counts.get("openrouter"), counts  # both paths, each record checked
    assert bool(counts.get("multi_turn")) == (mode == "trajectory"), counts  # trajectories folded from their turns
    from eagle3_data.storage import StageRef

    if mode == "trajectory":  # every user turn kept, every spliced tool result the one recorded for its call
        assert check_spliced_results(store, run_name, "conversations") > 0
        merged = Counter(store.read_manifest(StageRef(run_name, "merge", "all"))["extra"]["datasets"]["conversations"])
        user_turns = sum(
            m["role"] == "user"
            for r in map(json.loads, CONVERSATIONS.read_text().splitlines())
            for m in r.get("messages", [])
        ) + sum(
            t["from"] == "human"
            for r in map(json.loads, CONVERSATIONS.read_text().splitlines())
            for t in r.get("conversations", [])
        )
        assert merged["trajectory_samples_dropped"] == 0 and merged["trajectory_samples"] >= user_turns, merged
        assert merged["trajectory_samples"] == (
            merged["trajectory_samples_whole"]
            + merged["trajectory_samples_cut"]
            + merged["trajectory_samples_unfolded"]
        ), merged

    # the gate and the billing check are per turn: every local turn's ids validated, every overflow turn billed
    from eagle3_data.stages import BILLING_REPORT, VALIDATION_REPORT

    validate = StageRef(run_name, "validate", "conversations")
    local_turns = stage_rows(store, run_name, "generate_local", "conversations").values()
    rebuilt = stage_rows(store, run_name, "reconstruct", "conversations")
    sources = [r["source"] for b in store.iter_batches(validate) for r in b.to_pylist()]
    assert sources.count("sglang") == sum(r["status"] == "ok" for r in local_turns) > 0
    billing = store.get_json(validate, BILLING_REPORT)
    assert billing["rows"] + billing["excluded"]["rows"] + billing["missing_usage"]["rows"] == len(rebuilt) > 0
    # the calibration conversation's turns are compared, and both sides' turns scored by the policy check
    report = store.get_json(validate, VALIDATION_REPORT)
    assert report["calibration"]["samples"] > 0 and not report["calibration"]["missing"], report["calibration"]
    scored = store.read_manifest(StageRef(run_name, "score_policy", "conversations"))["extra"]
    assert scored["scored"]["local"] > 0 and scored["scored"]["overflow"] > 0, scored
    local = store.read_manifest(StageRef(run_name, "generate_local", "conversations"))
    if mode == "final_turn":
        assert "conversations" not in local["extra"] and sum(counts.values()) == 4
    else:
        figures = local["extra"]["conversations"]
        assert figures["mode"] == f"{mode}/{history}" and figures["samples"] >= counts["sglang"]
        from eagle3_data.report import load_run_report, render_html

        report = load_run_report(store, run_name)  # the run report shows them, per path
        entry = next(d for d in report.datasets if d.name == "conversations")
        assert entry.generation["conversations"]["local"] == figures
        html = render_html(report, title="t")
        assert "Conversations" in html and "splices hit / missed" in html and f"{mode}/{history}" in html
