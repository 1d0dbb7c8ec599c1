"""The DAG file parses cleanly, wires what docs/dag.md promises, and imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

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

    from eagle3_data.config import GPU_QUEUE, OPENROUTER_POOL, load_config

    bag = DagBag(dag_folder=str(REPO / "dags"))
    dag = bag.dags["eagle3_datagen"]
    tasks = dag.task_dict
    assert set(tasks) == {
        "audit_tokenizer",
        "dataset.load_route",
        "dataset.generate_local",
        "dataset.generate_overflow",
        "dataset.reconstruct",
        "dataset.validate",
        "merge",
        "extract_hidden_states",
        "publish",
    }
    assert tasks["dataset.generate_overflow"].pool == OPENROUTER_POOL
    assert tasks["dataset.generate_local"].queue == GPU_QUEUE
    assert tasks["extract_hidden_states"].queue == GPU_QUEUE
    for tid in ("dataset.generate_local", "dataset.generate_overflow", "audit_tokenizer"):
        assert tasks[tid].retries > 0 and tasks[tid].retry_exponential_backoff
    assert tasks["dataset.validate"].retries == 0  # a gate is data, not weather
    assert [o.name for o in tasks["publish"].outlets] == ["eagle3_training_data"]
    # order: audit -> per-dataset chain -> merge -> hidden states -> publish
    assert tasks["dataset.load_route"].upstream_task_ids == {"audit_tokenizer"}
    assert "dataset.reconstruct" in tasks["dataset.validate"].upstream_task_ids
    assert tasks["merge"].upstream_task_ids == {"dataset.validate"}
    assert tasks["publish"].upstream_task_ids == {"extract_hidden_states"}
    cfg = load_config()
    assert dag.params["datasets"] == cfg.dataset_names
    assert dag.schedule == cfg.schedule
