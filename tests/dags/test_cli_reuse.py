"""One wiring: the CLI's stage commands and the DAG run the same stage functions with the same
params, so a stage either one commits is reused by the other, for every stage of a run:
generation (local and overflow), reconstruct, the policy check's scoring, validate, merge and hidden states.
Reused means
nothing is requested again and no manifest is rewritten (same manifest sha256, same ETag)."""

from __future__ import annotations

import pytest
import yaml

from eagle3_data.cli import main
from eagle3_data.config import DAG_ID
from tests.fixtures.airflow import REPO, dag_stack

pytestmark = pytest.mark.slow

SAMPLES = 4
DATASET = "chat"
STAGES = (
    "audit",
    "prompts",
    "generate_local",
    "generate_overflow",
    "reconstruct",
    "score_policy",
    "validate",
    "merge",
    "hidden_states",
)
OVERRIDES = {
    "generation": {"sampling": {"max_new_tokens": 96}, "local": {"rows_per_part": 2}, "overflow": {"rows_per_part": 2}},
    "routing": {"overflow_fraction": 0.5, "calibration_samples": 0},
    "validation": {"max_bpe_mismatch_rate": 1.0, "max_billing_deviation": 1.0},
    "merge": {"max_length": 256, "shard_tokens": 512},
    "datasets": [{"name": DATASET}],
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, airflow_db):
    work = tmp_path_factory.mktemp("cli-reuse")
    with dag_stack(work, (DATASET,), SAMPLES, "2026-08-01", config_overrides=OVERRIDES) as s:
        # manual runs read one undated file: the dataset's prompts, the same for both sides
        raw = yaml.safe_load(s.config_path.read_text())
        raw["datasets"][0]["prompts"] = str(work / f"{DATASET}.jsonl")
        s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        yield s


@pytest.fixture
def cli_env(stack, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", stack.s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", stack.s3.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", stack.s3_endpoint)
    monkeypatch.setenv("OPENROUTER_API_KEY", "dev-key-not-a-secret")
    return stack


def _store(stack):
    from eagle3_data.config import load_config
    from eagle3_data.pipeline import open_store

    return open_store(load_config(stack.config_path), stack.client())


def _state(stack, run_key: str) -> dict[str, tuple[str, str]]:
    """Every stage's manifest: (manifest_sha256, ETag) by stage."""
    from eagle3_data.storage import StageRef

    store, out = _store(stack), {}
    for stage in STAGES:
        dataset = {"audit": "tokenizer", "merge": "all", "hidden_states": "all"}.get(stage, DATASET)
        ref = StageRef(run_key, stage, dataset)
        head = store.head_object(ref, "_manifest.json")
        assert head is not None, f"{store.uri(ref)} is not complete"
        out[stage] = (store.read_manifest(ref)["manifest_sha256"], head["ETag"])
    return out


def _cli(stack, run_key: str) -> None:
    """The newcomer's path: each command takes the URI the previous one printed."""
    prompts = yaml.safe_load(stack.config_path.read_text())["datasets"][0]["prompts"]
    base = ["--config", str(stack.config_path), "--dataset", DATASET, "--prompts", prompts, "--run-key", run_key]
    assert main(["generate", "local", *base, "--endpoint", stack.inference_url]) == 0
    assert main(["generate", "overflow", *base, "--base-url", stack.inference_url + "/v1"]) == 0
    store = _store(stack)
    run = f"s3://{store.bucket}/{store.prefix}/runs/{run_key}"
    config = ["--config", str(stack.config_path)]
    assert main(["reconstruct", *config, "--input", f"{run}/generate_overflow/{DATASET}"]) == 0
    assert (
        main(["score-policy", *config, "--input", f"{run}/reconstruct/{DATASET}", "--endpoint", stack.inference_url])
        == 0
    )
    assert main(["validate", *config, "--input", f"{run}/reconstruct/{DATASET}"]) == 0
    assert main(["merge", *config, "--input", f"{run}/validate/{DATASET}"]) == 0
    assert main(["extract", *config, "--input", f"{run}/merge/all"]) == 0


def _dag_run(run_key: str):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
    return dag.test(logical_date=None, run_conf={"run_name": run_key})  # a manual run: no date partition


def _requests(stack) -> int:
    return sum(sum(v.values()) for v in stack.server_stats()["requests"].values())


def test_stages_the_cli_committed_are_reused_by_the_dag(cli_env, capsys):
    _cli(cli_env, "cli-first")
    before, requests = _state(cli_env, "cli-first"), _requests(cli_env)
    assert requests >= SAMPLES
    dr = _dag_run("cli-first")
    assert str(dr.state).endswith("success")
    assert _state(cli_env, "cli-first") == before  # not one manifest rewritten
    assert _requests(cli_env) == requests  # nothing asked again


def test_stages_the_dag_committed_are_reused_by_the_cli(cli_env, capsys):
    assert str(_dag_run("dag-first").state).endswith("success")
    before, requests = _state(cli_env, "dag-first"), _requests(cli_env)
    capsys.readouterr()
    _cli(cli_env, "dag-first")
    assert _state(cli_env, "dag-first") == before
    assert _requests(cli_env) == requests
    printed = capsys.readouterr().out
    assert printed.count('"reused": true') >= 2 and "(already done)" in printed  # both generation stages, the shards


def _config_with(stack, tmp_path, name: str, change) -> str:
    raw = yaml.safe_load(stack.config_path.read_text())
    change(raw)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_a_generation_stage_made_with_other_settings_is_refused_not_reused(cli_env, capsys, tmp_path):
    """A complete generation stage is reused only for the settings that made it: a rerun after
    `generation.overflow.model` or `model.name` changed (neither is part of the prompts stage, so
    before this check the old answers were reused silently) stops with exit 2 naming the
    setting, asks nothing, and loses nothing (the original config still reuses the answers)."""
    prompts = yaml.safe_load(cli_env.config_path.read_text())["datasets"][0]["prompts"]
    run = ["--dataset", DATASET, "--prompts", prompts, "--run-key", "settings"]
    local = ["generate", "local", *run, "--endpoint", cli_env.inference_url]
    overflow = ["generate", "overflow", *run, "--base-url", cli_env.inference_url + "/v1"]
    same = ["--config", str(cli_env.config_path)]
    assert main([*local, *same]) == 0 and main([*overflow, *same]) == 0
    requests = _requests(cli_env)

    def other_provider_model(raw):
        raw.setdefault("generation", {}).setdefault("overflow", {})["model"] = "another/model"

    def other_target(raw):
        raw.setdefault("model", {})["name"] = "another-target"

    capsys.readouterr()
    assert main([*overflow, "--config", _config_with(cli_env, tmp_path, "provider", other_provider_model)]) == 2
    err = capsys.readouterr().err
    assert 'model "moonshotai/kimi-k2.5" (committed) vs "another/model" (this run)' in err, err
    assert "is complete with answers generated with other settings" in err and "stage discard s3://" in err, err
    assert main([*local, "--config", _config_with(cli_env, tmp_path, "target", other_target)]) == 2
    err = capsys.readouterr().err
    assert 'vs "another-target" (this run)' in err, err
    assert _requests(cli_env) == requests  # nothing asked
    assert main([*local, *same]) == 0 and main([*overflow, *same]) == 0  # nothing lost: reused as before
    assert _requests(cli_env) == requests
