"""Pipeline config: the shipped file loads, bad values are refused naming the key, params apply."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import yaml

from eagle3_data.chat_format import FORMATS
from eagle3_data.config import DEFAULT_CONFIG_PATH, load_config
from eagle3_data.errors import UserError


def _write(tmp_path, mutate):
    raw = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    mutate(raw)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_shipped_config_loads():
    cfg = load_config()
    assert cfg.tokenizer.expected_special_ids == {} and cfg.model.family is None  # the family's ids are audited
    assert FORMATS["kimi_k2"].reference_ids["<|im_end|>"] == 163586
    assert cfg.dataset_names == ["tool_calls", "code", "chat"]
    assert cfg.validation.max_bpe_mismatch_rate == 0.10 and cfg.validation.max_billing_deviation == 0.01
    assert cfg.schedule == "@daily"


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda r: r["routing"].update(overflow_fraction=1.5), "routing.overflow_fraction"),
        (lambda r: r["routing"].update(strategy="random"), "routing.strategy"),
        (lambda r: r["merge"].update(length_policy="squash"), "merge.length_policy"),
        (lambda r: r["hidden_states"].update(convention="middle"), "hidden_states.convention"),
        (
            lambda r: r["tokenizer"].update(expected_special_ids={"<|im_end|>": "x"}),
            "tokenizer.expected_special_ids.<|im_end|>",
        ),
        (lambda r: r["datasets"].append({"name": "chat"}), "datasets[3].name"),
        (
            lambda r: r["datasets"][1].update(validation={"max_bpe_mismatch_rate": 2}),
            "datasets[1].validation.max_bpe_mismatch_rate",
        ),
        (lambda r: r["generation"]["sampling"].update(max_new_tokens=True), "generation.sampling.max_new_tokens"),
    ],
)
def test_bad_values_name_the_key(tmp_path, mutate, key):
    with pytest.raises(UserError, match=key.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        load_config(_write(tmp_path, mutate))


def test_env_override_and_per_dataset_thresholds(tmp_path, monkeypatch):
    path = _write(tmp_path, lambda r: r["datasets"][2].update(validation={"max_bpe_mismatch_rate": 0.3}))
    monkeypatch.setenv("EAGLE3_CONFIG", str(path))
    cfg = load_config()
    assert cfg.dataset("chat").validation.max_bpe_mismatch_rate == 0.3
    assert cfg.dataset("code").validation.max_bpe_mismatch_rate == 0.10


def test_params_override_config_and_pick_the_run_key():
    from eagle3_data.pipeline import resolve_run

    day = datetime(2026, 11, 3, 5, tzinfo=timezone.utc)
    run = resolve_run({"datasets": ["chat"], "overflow_fraction": 0.5, "max_billing_deviation": 0.2}, day)
    assert run.run_key == "date=2026-11-03" and run.date == "2026-11-03" and run.datasets == ["chat"]
    assert run.config.routing.overflow_fraction == 0.5
    assert {d.validation.max_billing_deviation for d in run.config.datasets} == {0.2}
    assert resolve_run({"run_name": "exp-1"}, None).run_key == "exp-1"
    with pytest.raises(UserError, match="routing.overflow_fraction"):
        resolve_run({"overflow_fraction": 3}, day)
    with pytest.raises(UserError, match="nope"):
        resolve_run({"datasets": ["nope"]}, day)


def test_routing_is_stable_and_exact():
    """The pipeline's routing config is what stages.prompts.routing.assign_routes takes."""
    from eagle3_data.stages.prompts.routing import assign_routes

    cfg = load_config().with_overrides({"routing": {"overflow_fraction": 0.25, "calibration_samples": 2}})
    ids = [f"s{i}" for i in range(20)]
    routed = assign_routes(ids, cfg.routing)
    assert routed.count("overflow") == 5 and routed.count("both") == 2 and routed.count("local") == 13
    shuffled = assign_routes(ids[::-1], cfg.routing)
    assert dict(zip(ids[::-1], shuffled)) == dict(zip(ids, routed))
    capacity = cfg.with_overrides({"routing": {"strategy": "capacity", "local_capacity": 3, "calibration_samples": 0}})
    assert assign_routes(ids, capacity.routing).count("local") == 3


# -- strictness: unknown keys are refused, naming the key and the nearest valid one -------------
def _refused(tmp_path, mutate) -> list[str]:
    with pytest.raises(UserError) as exc:
        load_config(_write(tmp_path, mutate))
    return str(exc.value).splitlines()


def test_typo_in_file_is_refused_with_suggestion(tmp_path):
    lines = _refused(tmp_path, lambda r: r["validation"].update(max_bpe_mismatch_rat=0.01))
    assert lines == ["config validation.max_bpe_mismatch_rat: unknown key (did you mean max_bpe_mismatch_rate?)"]


def test_typo_in_dataset_overrides_is_refused(tmp_path):
    def mutate(r):
        r["datasets"][2]["validation"] = {"max_billing_deviaton": 0.5}
        r["datasets"][0]["dev"] = {"bpe_split": 0.1}

    lines = _refused(tmp_path, mutate)
    assert (
        "config datasets[2].validation.max_billing_deviaton: unknown key (did you mean max_billing_deviation?)" in lines
    )
    assert "config datasets[0].dev.bpe_split: unknown key (did you mean bpe_split_rate?)" in lines


def test_every_bad_key_is_reported_one_line_each(tmp_path):
    def mutate(r):
        r["merge"]["max_lenght"] = 512
        r["routing"]["overflow_fraction"] = 1.5
        r["hidden_states"]["convetion"] = "input"
        r["unknown_section"] = {}

    lines = _refused(tmp_path, mutate)
    assert len(lines) == 4, lines
    assert "config merge.max_lenght: unknown key (did you mean max_length?)" in lines
    assert "config hidden_states.convetion: unknown key (did you mean convention?)" in lines
    assert any(line.startswith("config routing.overflow_fraction: ") for line in lines)
    assert any(line.startswith("config unknown_section: unknown key (valid: storage, ") for line in lines)


def test_typo_in_trigger_overrides_is_refused():
    cfg = load_config()
    with pytest.raises(
        UserError, match=r"^params routing\.overflow_fractio: unknown key \(did you mean overflow_fraction\?\)$"
    ):
        cfg.with_overrides({"routing": {"overflow_fractio": 0.3}}, where="params")


def test_unknown_trigger_param_is_refused_naming_it():
    from eagle3_data.pipeline import resolve_run

    day = datetime(2026, 11, 3, tzinfo=timezone.utc)
    with pytest.raises(UserError) as exc:
        resolve_run({"max_bpe_mismatch_rat": 0.5, "unknown_param": 1}, day)
    first, second = str(exc.value).splitlines()
    assert first == "params.max_bpe_mismatch_rat: unknown param (did you mean max_bpe_mismatch_rate?)"
    assert second.startswith("params.unknown_param: unknown param (valid: datasets, run_name, ")


def test_dataset_overrides_are_the_same_model_and_inherit_the_rest(tmp_path):
    path = _write(tmp_path, lambda r: r["datasets"][2].update(validation={"allow_unvalidated_overflow": True}))
    cfg = load_config(path)
    chat, code = cfg.dataset("chat").validation, cfg.dataset("code").validation
    assert chat.allow_unvalidated_overflow and not code.allow_unvalidated_overflow
    assert chat.max_bpe_mismatch_rate == code.max_bpe_mismatch_rate == cfg.validation.max_bpe_mismatch_rate
    assert type(chat) is type(cfg.validation)


def test_agreed_fields_and_defaults():
    cfg = load_config()
    assert cfg.hidden_states.backend == "transformers" and cfg.hidden_states.tensor_parallel_size == 1
    assert cfg.generation.local.engine == "sglang" and cfg.generation.local.max_endpoint_failures == 3
    assert cfg.generation.local.warmup_timeout_s == 600
    assert cfg.generation.overflow.concurrency == 256
    assert cfg.validation.max_bad_row_rate == 0.0 and cfg.validation.max_missing_usage_rate == 0.0
    assert cfg.validation.allow_unvalidated_overflow is False
    assert cfg.limits.max_message_bytes == 1_000_000 and cfg.limits.max_prompt_tokens is None


def test_config_is_frozen():
    from pydantic import ValidationError

    cfg = load_config()
    with pytest.raises(ValidationError):
        cfg.merge.max_length = 1  # type: ignore[misc]


def test_default_config_is_package_data():
    """The default lives inside the package (a wheel has it) and names no checkout path."""
    from pathlib import Path

    import eagle3_data

    assert DEFAULT_CONFIG_PATH.is_relative_to(Path(eagle3_data.__file__).parent)
    cfg = load_config()
    assert cfg.tokenizer.source == "dev:kimi-tokenizer" and cfg.model.source == "dev:tiny-kimi-k25"


def test_dev_sources_resolve_to_the_cached_builds(tmp_path, monkeypatch, kimi_tokenizer_dir):
    from eagle3_data.config import resolve_source

    monkeypatch.setenv("EAGLE3_DATA_CACHE", str(tmp_path))
    (tmp_path / "dev").mkdir()
    # the same build key as the session's tokenizer: link it in instead of rebuilding
    (tmp_path / "dev" / kimi_tokenizer_dir.name).symlink_to(kimi_tokenizer_dir)
    assert resolve_source("dev:kimi-tokenizer") == str(tmp_path / "dev" / kimi_tokenizer_dir.name)
    assert resolve_source("s3://b/tok") == "s3://b/tok" and resolve_source("/abs/tok") == "/abs/tok"
    with pytest.raises(UserError, match="dev:nope: unknown dev build"):
        resolve_source("dev:nope")


# -- runs without a logical date ---------------------------------------------------------------
def test_run_without_logical_date_or_run_name_keys_on_its_run_id():
    """A REST trigger without a logical date (the API's default) used to fail in audit_tokenizer."""
    from eagle3_data.pipeline import resolve_run

    assert (
        resolve_run({}, None, run_id="manual__2026-12-01T10:00:00+00:00").run_key == "manual__2026-12-01T10-00-00+00-00"
    )
    with pytest.raises(UserError, match="manual run needs a run_name"):
        resolve_run({}, None)


def test_undated_run_checks_its_prompts_in_the_first_task(tmp_path):
    """A run without a logical date reads undated prompts or the newest partition
    (tests/unit/test_prompts.py); the first task fails when a dataset has neither."""
    from eagle3_data.pipeline import check_prompt_sources, resolve_run

    root = tmp_path / "prompts"
    (root / "chat").mkdir(parents=True)
    cfg = load_config().with_overrides({"prompts_root": str(root)})

    class Store:
        client = None

    run = resolve_run({"run_name": "manual", "datasets": ["chat"]}, None, cfg)
    with pytest.raises(
        UserError,
        match=r"dataset chat: a run without a logical date reads the newest date partition "
        r"or undated prompts, and found neither",
    ):
        check_prompt_sources(run, Store())
    (root / "chat" / "date=2026-11-01").mkdir(parents=True)
    (root / "chat" / "date=2026-11-01" / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    check_prompt_sources(run, Store())  # its newest partition
    (root / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    check_prompt_sources(run, Store())  # an undated file: fine
    check_prompt_sources(resolve_run({"datasets": ["chat"]}, datetime(2026, 11, 1, tzinfo=timezone.utc), cfg), Store())


# -- eagle3-data config check ------------------------------------------------------------------
def test_config_check_prints_the_resolved_config(capsys):
    from eagle3_data.cli import main

    assert main(["config", "check", str(DEFAULT_CONFIG_PATH)]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["datasets"][2]["validation"]["max_bpe_mismatch_rate"] == 0.10  # inherited, shown
    assert resolved["generation"]["local"]["engine"] == "sglang"  # defaults filled


def test_config_check_exits_2_naming_every_bad_key(tmp_path, capsys):
    from eagle3_data.cli import main

    def mutate(r):
        r["validation"]["max_bpe_mismatch_rat"] = 0.01
        r["datasets"][1]["validaton"] = {}

    assert main(["config", "check", str(_write(tmp_path, mutate))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "eagle3-data: error: config validation.max_bpe_mismatch_rat: unknown key (did you mean max_bpe_mismatch_rate?)",
        "eagle3-data: error: config datasets[1].validaton: unknown key (did you mean validation?)",
    ]


def test_an_empty_section_means_its_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, lambda r: r.update(routing=None, merge=None)))
    assert cfg.routing.strategy == "fraction" and cfg.routing.overflow_fraction == 0.0
    assert cfg.merge.max_length == 8192
    lines = _refused(tmp_path, lambda r: r.update(datasets="chat"))
    assert lines == ["config datasets: Input should be a list (got 'chat')"]


def test_a_run_picks_a_packaged_config_by_its_family():
    """The trigger param `config` runs a packaged config (by its target's family) instead of the
    DAG's own; the form's other params apply on top; a name that is no packaged config, or a
    config whose datasets are not the DAG's tasks', is refused naming the param."""
    from eagle3_data.config import PACKAGED_CONFIGS
    from eagle3_data.pipeline import resolve_run

    assert set(PACKAGED_CONFIGS) == set(FORMATS)  # one dev config per family
    for family, path in PACKAGED_CONFIGS.items():
        assert load_config(path).model.family in (family, None)
    day = datetime(2026, 11, 3, tzinfo=timezone.utc)
    run = resolve_run({"config": "qwen3", "max_usd": 3.0}, day)
    assert run.config.model.family == "qwen3" and run.config.tokenizer.source == "dev:qwen3-tokenizer"
    assert run.config.generation.overflow.max_usd == 3.0
    assert resolve_run({"config": None}, day).config.tokenizer.source == "dev:kimi-tokenizer"
    with pytest.raises(UserError, match="params.config: 'llama3' is no packaged config"):
        resolve_run({"config": "llama3"}, day)
    other = load_config().with_overrides({"datasets": load_config().raw["datasets"][:1]}, where="test")
    with pytest.raises(UserError, match="params.config: 'qwen3' names datasets"):
        resolve_run({"config": "qwen3"}, day, other)
