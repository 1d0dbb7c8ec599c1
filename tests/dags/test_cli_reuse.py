"""One wiring: the CLI's stage commands and the DAG run the same stage functions with the same
params, so a stage either one commits is reused by the other, for every stage of a run:
generation (local and overflow), reconstruct, the policy check's scoring, validate, merge and hidden states.
Reused means
nothing is requested again and no manifest is rewritten (same manifest sha256, same ETag)."""

from __future__ import annotations

import pytest
import yaml
from eagle3_airflow import DAG_ID

from eagle3_data.cli import main
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
    assert "is committed from other inputs than this run's" in err and "--fresh generate_overflow" in err, err
    assert main([*local, "--config", _config_with(cli_env, tmp_path, "target", other_target)]) == 2
    err = capsys.readouterr().err
    assert 'vs "another-target" (this run)' in err, err
    assert _requests(cli_env) == requests  # nothing asked
    assert main([*local, *same]) == 0 and main([*overflow, *same]) == 0  # nothing lost: reused as before
    assert _requests(cli_env) == requests


# -- a refused run changes nothing ----------------------------------------------------------------------
def _objects(stack, run_key: str) -> dict[str, str]:
    """Every object of the run key, (key -> ETag), leases aside: what a refused command must leave
    exactly as it was (an ETag changes when an object is rewritten, even with the same bytes on
    some servers; a key appears or vanishes when one is written or deleted)."""
    store = _store(stack)
    base = f"{store.prefix}/runs/{run_key}/"
    return {
        o["Key"]: o["ETag"] for o in store.list_objects(base) if not o["Key"].rsplit("/", 1)[-1].startswith("_lease")
    }


def _other_prompts(stack, tmp_path) -> str:
    """A prompt file of the same dataset with other rows (the sample file's next lines)."""
    from eagle3_devtools.stack import SAMPLE_DATA

    lines = (SAMPLE_DATA / f"{DATASET}.jsonl").read_text().splitlines()[SAMPLES : 2 * SAMPLES]
    path = tmp_path / "b.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _generate(stack, side: str, prompts: str, run_key: str, *extra: str) -> int:
    url = ["--endpoint", stack.inference_url] if side == "local" else ["--base-url", stack.inference_url + "/v1"]
    run = ["--config", str(stack.config_path), "--dataset", DATASET, "--prompts", prompts, "--run-key", run_key]
    return main(["generate", side, *run, *url, *extra])


def test_other_prompts_under_a_used_run_key_change_nothing_and_lose_nothing(cli_env, capsys, tmp_path):
    """The issue's scenario: a.jsonl then b.jsonl under one run key. The second command used to
    rewrite the committed prompts stage and delete generate_local's manifest before refusing.
    Now every command with b exits 2 naming the input that differs and the real way out
    (`--fresh` with every stage built on it), and not one object of the run changes; the run with
    a.jsonl then goes on as if nothing happened, asking the provider nothing."""
    a = yaml.safe_load(cli_env.config_path.read_text())["datasets"][0]["prompts"]
    b = _other_prompts(cli_env, tmp_path)
    assert _generate(cli_env, "local", a, "k1") == 0 and _generate(cli_env, "overflow", a, "k1") == 0
    before, requests = _objects(cli_env, "k1"), _requests(cli_env)
    capsys.readouterr()
    for side in ("local", "overflow", "local"):
        assert _generate(cli_env, side, b, "k1") == 2
        err = capsys.readouterr().err
        assert f'source "{a}" (committed) vs "{b}" (this run)' in err, err
        assert "--fresh prompts --fresh generate_local --fresh generate_overflow" in err, err
        assert "fresh=True" not in err and "unfinished attempt" not in err, err
        assert _objects(cli_env, "k1") == before
    # naming only the prompts stage is refused too: generation stages were built on it
    assert _generate(cli_env, "local", b, "k1", "--fresh", "prompts") == 2
    assert "cannot be replaced alone" in capsys.readouterr().err
    assert _objects(cli_env, "k1") == before
    assert _generate(cli_env, "local", a, "k1") == 0 and _generate(cli_env, "overflow", a, "k1") == 0
    assert _objects(cli_env, "k1") == before and _requests(cli_env) == requests


def test_a_fresh_replacement_archives_paid_answers_and_a_later_run_takes_them_back(cli_env, capsys, tmp_path):
    """`--fresh` names what it replaces; the paid answers of the replaced stages move to the
    archive, and going back to the first prompts asks the provider nothing for them."""
    a = yaml.safe_load(cli_env.config_path.read_text())["datasets"][0]["prompts"]
    b = _other_prompts(cli_env, tmp_path)
    assert _generate(cli_env, "local", a, "k2") == 0 and _generate(cli_env, "overflow", a, "k2") == 0
    fresh = ["--fresh", "prompts", "--fresh", "generate_local", "--fresh", "generate_overflow"]
    requests = _requests(cli_env)
    assert _generate(cli_env, "local", b, "k2", *fresh) == 0
    assert _generate(cli_env, "overflow", b, "k2", *fresh) == 0
    asked_for_b = _requests(cli_env) - requests
    assert asked_for_b >= SAMPLES  # b's prompts are new: asked
    store = _store(cli_env)
    archived = {o["Key"] for o in store.list_objects(f"{store.prefix}/archive/k2/")}
    assert any(k.endswith("_archived.json") and "/generate_overflow/" in k for k in archived), archived
    requests = _requests(cli_env)
    assert _generate(cli_env, "local", a, "k2", *fresh) == 0 and _generate(cli_env, "overflow", a, "k2", *fresh) == 0
    assert _requests(cli_env) == requests  # a's answers came back from the archive, b's went to it
    from eagle3_data.storage import StageRef

    for stage in ("generate_local", "generate_overflow"):
        manifest = store.read_manifest(StageRef("k2", stage, DATASET))
        assert manifest["extra"]["counts"]["from_archive"] == manifest["rows"] > 0, (stage, manifest["extra"])


def _other_template_tokenizer(tmp_path) -> str:
    """The run's tokenizer with one comment added to its chat template: the same ids, another
    template sha256 (what a silently edited template looks like)."""
    import shutil

    from eagle3_data.config import resolve_source

    copy = tmp_path / "tokenizer"
    shutil.copytree(resolve_source("dev:kimi-tokenizer"), copy)
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text() + "{#- edited -#}\n")
    return str(copy)


REFUSALS = {
    # command (after the whole chain of run key "k3"), the change against that chain, the stage named
    "generate local: another tokenizer": (["generate", "local"], {}, ["--tokenizer", "TOKENIZER"], "audit"),
    "generate overflow: another provider model": (
        ["generate", "overflow"],
        {"generation": {"overflow": {"model": "another/model"}}},
        [],
        "generate_overflow",
    ),
    "reconstruct: another generation mode": (
        ["reconstruct"],
        {"generation": {"sampling": {"thinking": False}}},
        [],
        "reconstruct",
    ),
    "score-policy: another seed": (["score-policy"], {"policy": {"seed": 7}}, [], "score_policy"),
    "validate: another threshold": (["validate"], {"validation": {"max_bad_row_rate": 0.5}}, [], "validate"),
    "merge: another max_length": (["merge"], {"merge": {"max_length": 200}}, [], "merge"),
    "extract: another convention": (["extract"], {"hidden_states": {"convention": "input"}}, [], "hidden_states"),
}


@pytest.fixture(scope="module")
def chain_k3(stack):
    import os

    env = {
        "AWS_ACCESS_KEY_ID": stack.s3.access_key,
        "AWS_SECRET_ACCESS_KEY": stack.s3.secret_key,
        "AWS_ENDPOINT_URL": stack.s3_endpoint,
        "OPENROUTER_API_KEY": "dev-key-not-a-secret",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        _cli(stack, "k3")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return "k3"


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_every_stage_command_refuses_a_conflict_before_its_first_write(cli_env, chain_k3, capsys, tmp_path, case):
    """Each stage command, run again on a committed chain with one input changed, exits 2 naming
    the change and the `--fresh` flags that exist for it, and the run key's objects (key, ETag)
    are exactly as they were: the refusal came before any write."""
    command, change, flags, stage = REFUSALS[case]

    def changed(raw):
        from eagle3_data.config import deep_merge

        deep_merge(raw, change)

    config = _config_with(cli_env, tmp_path, "changed", changed)
    flags = [_other_template_tokenizer(tmp_path) if f == "TOKENIZER" else f for f in flags]
    store = _store(cli_env)
    run = f"s3://{store.bucket}/{store.prefix}/runs/{chain_k3}"
    inputs = {
        "reconstruct": f"{run}/generate_overflow/{DATASET}",
        "score-policy": f"{run}/reconstruct/{DATASET}",
        "validate": f"{run}/reconstruct/{DATASET}",
        "merge": f"{run}/validate/{DATASET}",
        "extract": f"{run}/merge/all",
    }
    if command[0] == "generate":
        prompts = yaml.safe_load(cli_env.config_path.read_text())["datasets"][0]["prompts"]
        side = (
            ["--endpoint", cli_env.inference_url]
            if command[1] == "local"
            else ["--base-url", cli_env.inference_url + "/v1"]
        )
        argv = [*command, "--dataset", DATASET, "--prompts", prompts, "--run-key", chain_k3, *side]
    else:
        argv = [*command, "--input", inputs[command[0]]]
        if command[0] == "score-policy":
            argv += ["--endpoint", cli_env.inference_url]
    before, requests = _objects(cli_env, chain_k3), _requests(cli_env)
    capsys.readouterr()
    assert main([*argv, "--config", config, *flags]) == 2
    err = capsys.readouterr().err
    assert "is committed from other inputs than this run's" in err and f"--fresh {stage}" in err, err
    assert _objects(cli_env, chain_k3) == before
    assert _requests(cli_env) == requests


def test_a_stage_held_by_another_writer_refuses_and_changes_nothing(cli_env, chain_k3, capsys):
    """A rerun while another writer holds the stage's lease: StageBusy, exit 2, nothing touched."""
    from eagle3_data.storage import StageRef

    store = _store(cli_env)
    prompts = yaml.safe_load(cli_env.config_path.read_text())["datasets"][0]["prompts"]
    before = _objects(cli_env, chain_k3)
    capsys.readouterr()
    with store.lease(StageRef(chain_k3, "generate_local", DATASET)):
        code = _generate(cli_env, "local", prompts, chain_k3, "--rerun", "--fresh", "reconstruct")
    assert code == 2, capsys.readouterr()
    assert _objects(cli_env, chain_k3) == before


def test_a_refused_dag_run_changes_no_stage(cli_env, chain_k3):
    """The DAG's tasks refuse as the CLI does: a run under a used run key with another routing
    (the trigger form's overflow_fraction) fails in load_route, naming the param and the
    fresh_stages that would replace the stages, and asks nothing; no stage's object changes. The
    refused dataset is not merged or published on the stages an earlier run committed: the run
    ends failed, its publish summary (that run's result) untouched. The run report (runs/K/
    report/run/, an index of the run a person opens from its run page, written by publish for a
    failed run too) is the one object such a run writes."""
    from airflow.dag_processing.dagbag import DagBag

    before, requests = _objects(cli_env, chain_k3), _requests(cli_env)
    dag = DagBag(dag_folder=str(REPO / "dags")).dags[DAG_ID]
    dr = dag.test(logical_date=None, run_conf={"run_name": chain_k3, "overflow_fraction": 0.25})
    assert str(dr.state).endswith("failed")
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert states["dataset.load_route"].endswith("failed") and states["publish"].endswith("failed"), states
    after = _objects(cli_env, chain_k3)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert all(f"/runs/{chain_k3}/report/run/" in k for k in changed), changed
    assert _requests(cli_env) == requests
