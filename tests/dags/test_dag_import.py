"""The DAG file parses cleanly, wires what docs/dag.md promises, and imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.airflow import REPO

HEAVY = ("torch", "transformers", "pyarrow", "pandas", "tokenizers", "safetensors", "openai", "eagle3_data.pipeline")


def test_dag_file_imports_nothing_heavy():
    """Parse the DAG folder in a fresh interpreter and list heavy modules it pulled in."""
    code = (
        "import json, sys\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags')!r})\n"
        f"print(json.dumps({{'errors': {{k: str(v) for k, v in bag.import_errors.items()}}, 'dags': sorted(bag.dags),"
        f" 'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert "eagle3_datagen" in result["dags"]
    assert result["heavy"] == [], f"DAG parsing imported heavy modules: {result['heavy']}"


def test_dag_wiring():
    from airflow.dag_processing.dagbag import DagBag
    from eagle3_airflow import GPU_QUEUE, OPENROUTER_POOL

    from eagle3_data.config import load_config

    bag = DagBag(dag_folder=str(REPO / "dags"))
    dag = bag.dags["eagle3_datagen"]
    tasks = dag.task_dict
    assert set(tasks) == {
        "audit_tokenizer",
        "dataset.load_route",
        "dataset.generate_local",
        "dataset.generate_overflow",
        "dataset.reconstruct",
        "dataset.score_policy",
        "dataset.validate",
        "merge",
        "plan_hidden_states",
        "extract_hidden_states",
        "commit_hidden_states",
        "probe",
        "publish",
    }
    assert tasks["dataset.generate_overflow"].pool == OPENROUTER_POOL
    assert tasks["dataset.generate_local"].queue == GPU_QUEUE
    assert tasks["extract_hidden_states"].queue == GPU_QUEUE
    assert tasks["probe"].queue == GPU_QUEUE  # it trains a drafter head
    assert tasks["dataset.score_policy"].queue == GPU_QUEUE  # it calls the local engine, as generation does
    for tid in ("dataset.generate_local", "dataset.generate_overflow", "audit_tokenizer"):
        assert tasks[tid].retries > 0 and tasks[tid].retry_exponential_backoff
    # a failed gate is AirflowFailException (never retried: data, not weather); a hang or an outage is
    assert tasks["dataset.validate"].retries > 0
    cfg = load_config()
    for tid, task in tasks.items():  # no task waits forever (docs/dag.md, "Timeouts")
        assert task.execution_timeout is not None and task.execution_timeout.total_seconds() > 0, tid
    assert tasks["merge"].execution_timeout.total_seconds() == cfg.timeouts.merge_s
    for tid in ("dataset.generate_local", "dataset.generate_overflow"):  # sized per run, bounded by the cap
        assert tasks[tid].execution_timeout.total_seconds() == cfg.timeouts.generation_cap_s
        assert tasks[tid]._pre_execute_hook is not None
    assert [o.name for o in tasks["publish"].outlets] == ["eagle3_training_data"]
    assert tasks["publish"].trigger_rule == "all_done"  # the run report is written for failed runs too
    # order: audit -> per-dataset chain -> merge -> hidden states -> publish
    assert tasks["dataset.load_route"].upstream_task_ids == {"audit_tokenizer"}
    # local and overflow generation run side by side from the routed prompts; reconstruct waits for both
    # (every task of the mapped group also depends on audit_tokenizer, which it is expanded over)
    upstream = {
        t: tasks[f"dataset.{t}"].upstream_task_ids - {"audit_tokenizer"}
        for t in ("generate_local", "generate_overflow", "reconstruct")
    }
    assert upstream["generate_local"] == upstream["generate_overflow"] == {"dataset.load_route"}
    assert upstream["reconstruct"] == {"dataset.generate_local", "dataset.generate_overflow"}
    # the policy check scores reconstructed answers; the gate decides on its figures
    assert "dataset.reconstruct" in tasks["dataset.score_policy"].upstream_task_ids
    assert "dataset.score_policy" in tasks["dataset.validate"].upstream_task_ids
    assert tasks["merge"].upstream_task_ids == {"dataset.validate"}
    # the hidden-states stage in its own tasks: plan -> mapped extraction -> commit, then the probe, then publish
    assert tasks["plan_hidden_states"].upstream_task_ids == {"merge"}
    assert tasks["extract_hidden_states"].upstream_task_ids == {"plan_hidden_states"}
    assert tasks["commit_hidden_states"].upstream_task_ids == {"extract_hidden_states"}
    assert tasks["probe"].upstream_task_ids == {"commit_hidden_states"}  # the drafter's verdict on the extraction
    assert tasks["publish"].upstream_task_ids == {"probe"}
    assert dag.params["datasets"] == cfg.dataset_names
    assert dag.schedule == cfg.schedule


def test_params_agree_with_the_config_models():
    """Every config-backed trigger param has its config field's type, enum, bounds and
    description, and refuses exactly what the config refuses at its bounds."""
    import typing

    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError

    from eagle3_data.config import (
        CONFIG_PARAMS,
        THRESHOLD_PARAMS,
        TRIGGER_PARAMS,
        config_field,
        config_value,
        load_config,
    )
    from eagle3_data.errors import UserError

    params = DagBag(dag_folder=str(REPO / "dags")).dags["eagle3_datagen"].params
    cfg = load_config()
    assert {"datasets", "run_name", "config", "skip_hidden_states", "dry_run", "fresh_stages", *CONFIG_PARAMS} == set(
        params.keys()
    )
    params.get_param("config").resolve("qwen3")  # a packaged config, by its family
    with pytest.raises(ParamValidationError):
        params.get_param("config").resolve("llama3")
    assert list(params.keys()) == list(TRIGGER_PARAMS)  # the form offers what resolve_run takes, in its order
    for name, path in CONFIG_PARAMS.items():
        param, info = params.get_param(name), config_field(path)
        schema = param.schema
        lo = next((m.ge for m in info.metadata if getattr(m, "ge", None) is not None), None)
        hi = next((m.le for m in info.metadata if getattr(m, "le", None) is not None), None)
        assert schema.get("minimum") == lo and schema.get("maximum") == hi, name
        kind = typing.get_origin(info.annotation)
        if kind is typing.Literal:
            assert schema["enum"] == list(typing.get_args(info.annotation)), name
        else:
            json_type = {float: "number", int: "integer", bool: "boolean"}[info.annotation]
            assert schema["type"] == ([json_type, "null"] if name in THRESHOLD_PARAMS else json_type), name
        assert info.description in param.description, name
        assert param.value == (None if name in THRESHOLD_PARAMS else config_value(cfg, path)), name
        *parents, leaf = path.split(".")
        for bad in [b for b in (lo is not None and lo - 1, hi is not None and hi + 1) if b is not False]:
            with pytest.raises(ParamValidationError):
                param.resolve(bad)
            override: dict = {leaf: bad}
            for part in reversed(parents):
                override = {part: override}
            with pytest.raises(UserError, match=path.replace(".", r"\.")):
                cfg.with_overrides(override)
