"""`balanced` routing and the dry-run plan take each side's rate from the previous run's
generation manifests of the dataset (observed latency, in flight) when there are any, else from
the config, and say which."""

from __future__ import annotations

import json

from eagle3_data.config import load_config
from eagle3_data.storage import StageRef
from eagle3_data.storage.writer import StageWriter

SIDES = {
    "generate_local": ("local", {"latency_s_mean": 2.0, "in_flight": {"http://a": 8, "http://b": 8}}),
    "generate_overflow": ("overflow", {"latency_s_mean": 1.0, "concurrency": 99}),
}


def commit(store, ref, extra):
    with StageWriter(store, ref, "generations", rows_per_part=1, tokenizer_sha256="t", template_sha256="t") as w:
        w.commit(extra=extra)


def config(tmp_path, kimi_tokenizer_dir):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n" for i in range(40))
    )
    return load_config().with_overrides(
        {
            "tokenizer": {"source": str(kimi_tokenizer_dir)},
            "datasets": [{"name": "chat", "prompts": str(prompts)}],
            "generation": {"local": {"in_flight_per_endpoint": 4}, "overflow": {"concurrency": 12}},
            "routing": {
                "strategy": "balanced",
                "calibration_samples": 2,
                "local_endpoints": 2,
                "local_latency_s": 8.0,
                "overflow_latency_s": 4.0,
            },
        },
        where="test",
    )


def test_balanced_routing_and_the_plan_use_the_previous_runs_manifests(store, kimi_tokenizer_dir, tmp_path):
    from eagle3_data import pipeline
    from eagle3_data.runs.run import Run

    cfg = config(tmp_path, kimi_tokenizer_dir)
    first = pipeline.load_route(
        Run(config=cfg, run_key="plan-0", date=None, datasets=["chat"], dry_run=True, skip_hidden_states=False),
        store,
        "chat",
    ).plan["estimate"]
    assert {side["source"] for side in first["rate_inputs"].values()} == {"config"}  # no previous run yet
    # config: local 2 x 4 / 8 s = 1 sample/s, overflow 12 / 4 s = 3/s -> (40 + 2) / 4 = 10.5 local
    assert first["strategies"]["balanced"]["local"] in (10, 11)

    for stage, (_, extra) in SIDES.items():
        commit(store, StageRef("old-format", stage, "chat"), {"endpoints": 2})  # no latency recorded: skipped
        commit(store, StageRef("previous", stage, "chat"), extra)
        commit(store, StageRef("other-dataset", stage, "code"), {**extra, "latency_s_mean": 100.0})
    plan_run = Run(config=cfg, run_key="plan-1", date=None, datasets=["chat"], dry_run=True, skip_hidden_states=False)
    estimate = pipeline.load_route(plan_run, store, "chat").plan["estimate"]
    inputs = estimate["rate_inputs"]
    for stage, (side, _) in SIDES.items():
        assert inputs[side]["source"] == store.uri(StageRef("previous", stage, "chat"))
    assert inputs["local"] == {**inputs["local"], "endpoints": 2, "in_flight_per_endpoint": 8, "latency_s": 2.0}
    # this run's concurrency over the previous run's latency (not its concurrency of 99)
    assert inputs["overflow"] == {**inputs["overflow"], "concurrency": 12, "latency_s": 1.0}
    assert estimate["rates_samples_per_s"] == {"local": 8.0, "overflow": 12.0}
    bal = estimate["strategies"]["balanced"]
    assert bal["local"] in (16, 17) and abs(bal["local_s"] - bal["overflow_s"]) <= 1 / 8  # (40 + 2) x 8 / 20

    # a real (not dry) run routes by the same inputs and records them with the prompts stage
    run = Run(config=cfg, run_key="real", date=None, datasets=["chat"], dry_run=False, skip_hidden_states=False)
    counts = pipeline.load_route(run, store, "chat").counts
    assert counts.get("local", 0) + counts.get("both", 0) == bal["local"]
    routing = store.read_manifest(pipeline.stage_ref(run, "prompts", "chat"))["params"]["routing"]
    assert routing["balance_inputs"]["local"]["source"] == inputs["local"]["source"]
    prompts_ref = pipeline.stage_ref(run, "prompts", "chat")
    first_manifest = store.read_manifest(prompts_ref)

    # a later run commits with other latencies; rerunning "real" (a clear, a backfill's
    # reprocessing) must route as its first attempt did: same prompts stage, nothing to pay again
    for stage, (_, extra) in SIDES.items():
        commit(store, StageRef("later", stage, "chat"), {**extra, "latency_s_mean": 0.05})
    assert pipeline.load_route(run, store, "chat").counts == counts
    assert store.read_manifest(prompts_ref) == first_manifest
    # a new run key takes the newest observations
    run2 = Run(config=cfg, run_key="real-2", date=None, datasets=["chat"], dry_run=False, skip_hidden_states=False)
    fresh = pipeline.load_route(run2, store, "chat").counts
    routing = store.read_manifest(pipeline.stage_ref(run2, "prompts", "chat"))["params"]["routing"]
    assert routing["balance_inputs"]["local"]["source"] == store.uri(StageRef("later", "generate_local", "chat"))
    assert fresh != counts  # local is 40x faster now: more samples go local


def test_generation_timeouts_are_sized_from_samples_and_measured_rates(store, kimi_tokenizer_dir, tmp_path):
    """The generation tasks' execution_timeout: margin x samples / rate, within floor and cap; the
    rate from the dataset's previous run when one was measured (else the config's)."""
    from eagle3_data.pipeline import generation_timeout
    from eagle3_data.runs.run import Run

    cfg = config(tmp_path, kimi_tokenizer_dir).with_overrides(
        {"timeouts": {"generation_floor_s": 100, "generation_cap_s": 5000, "generation_margin": 2.0}}, where="test"
    )
    run = Run(config=cfg, run_key="now", date=None, datasets=["chat"], dry_run=False, skip_hidden_states=False)
    counts = {"local": 300, "overflow": 290, "both": 10}
    # config rates: local 2 x 4 / 8 s = 1 sample/s; overflow 12 / 4 s = 3 samples/s
    assert generation_timeout(run, store, "chat", "generate_local", counts)[0] == 2.0 * 310 / 1.0
    assert generation_timeout(run, store, "chat", "generate_overflow", counts)[0] == 2.0 * 300 / 3.0
    assert generation_timeout(run, store, "chat", "generate_overflow", {"overflow": 1})[0] == 100  # the floor
    assert generation_timeout(run, store, "chat", "generate_local", {"local": 10**6})[0] == 5000  # the cap
    # rows asked for turn by turn count as their user turns, times the steps a trajectory may take
    turns = {"local": 40, "prompts": 40, "user_turns": 100}
    traj = run.config.with_overrides(
        {"generation": {"regenerate": "trajectory", "max_trajectory_steps": 4}}, where="test"
    )
    seconds, how = generation_timeout(Run(**{**vars(run), "config": traj}), store, "chat", "generate_local", turns)
    assert seconds == 2.0 * 40 * 2.5 * 4 / 1.0 and "2.5 user turns a row x 4 answers" in how
    every = run.config.with_overrides(
        {"generation": {"regenerate": "every_turn", "history": "regenerated"}}, where="test"
    )
    assert (
        generation_timeout(Run(**{**vars(run), "config": every}), store, "chat", "generate_local", turns)[0]
        == 2.0 * 100
    )
    for stage, (_, extra) in SIDES.items():
        commit(store, StageRef("previous", stage, "chat"), extra)
    # measured: local 2 endpoints x 8 in flight / 2 s = 8 samples/s; overflow 12 / 1 s = 12/s
    seconds, how = generation_timeout(run, store, "chat", "generate_local", counts)
    assert seconds == max(100, 2.0 * 310 / 8.0) and store.uri(StageRef("previous", "generate_local", "chat")) in how
    assert generation_timeout(run, store, "chat", "generate_overflow", counts)[0] == max(100, 2.0 * 300 / 12.0)
