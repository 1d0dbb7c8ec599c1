"""Pipeline config: the shipped file loads, bad values are refused naming the key, params apply."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import yaml

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
    assert cfg.tokenizer.expected_special_ids["<|im_end|>"] == 163586
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
        (lambda r: r["tokenizer"]["expected_special_ids"].update({"<|im_end|>": "x"}), "tokenizer.expected_special_ids.<|im_end|>"),
        (lambda r: r["datasets"].append({"name": "chat"}), "datasets[3].name"),
        (lambda r: r["datasets"][1].update(validation={"max_bpe_mismatch_rate": 2}), "datasets[1].validation.max_bpe_mismatch_rate"),
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
    """The pipeline's routing config maps onto generation.routing.assign_routes' keywords."""
    from eagle3_data.generation.routing import assign_routes

    cfg = load_config().with_overrides({"routing": {"overflow_fraction": 0.25, "calibration_samples": 2}})
    rows = [{"sample_id": f"s{i}"} for i in range(20)]
    routed = [r["route"] for r in assign_routes(rows, **vars(cfg.routing))]
    assert routed.count("overflow") == 5 and routed.count("both") == 2 and routed.count("local") == 13
    shuffled = assign_routes(list(reversed(rows)), **vars(cfg.routing))
    assert {r["sample_id"]: r["route"] for r in shuffled} == {r["sample_id"]: r["route"] for r in assign_routes(rows, **vars(cfg.routing))}
    capacity = cfg.with_overrides({"routing": {"strategy": "capacity", "local_capacity": 3, "calibration_samples": 0}})
    assert [r["route"] for r in assign_routes(rows, **vars(capacity.routing))].count("local") == 3
