"""Pipeline glue that needs no S3: the package keeps its stage names, and the run gate is
composed from the two checks' own decisions (no reason string is reinterpreted)."""

from __future__ import annotations

import pytest

from eagle3_data.config import load_config
from eagle3_data.storage.writer import StageWriter


def test_stage_functions_are_importable_from_the_package():
    from eagle3_data import pipeline

    for name in (
        "resolve_run",
        "open_store",
        "audit_tokenizer",
        "load_route",
        "generate_local",
        "generate_overflow",
        "reconstruct",
        "validate",
        "merge",
        "extract_hidden_states",
        "commit_hidden_states",
        "probe",
        "publish",
    ):
        assert callable(getattr(pipeline, name)), name


@pytest.mark.parametrize("allow", [False, True])
def test_no_local_samples_with_overflow_rows(allow):
    """A dataset whose local side validated nothing cannot vouch for its overflow rows: the gate
    fails unless the dataset allows unvalidated overflow, and is flagged either way."""
    from eagle3_data.pipeline import run_gate
    from eagle3_data.stages.validate import ValidationSummary, compare_billed_counts

    thresholds = load_config().validation.model_copy(update={"allow_unvalidated_overflow": allow})
    local = ValidationSummary(allow_unvalidated_overflow=allow).report()
    billing = compare_billed_counts([("s1", 10, 10), ("s2", 20, 20)])
    gate = run_gate(local, billing, thresholds)
    assert gate.unvalidated_overflow
    assert gate.passed is allow
    assert (gate.notes if allow else gate.reasons)[0].startswith("local round trip: ")


def test_local_samples_validated_is_not_flagged():
    from eagle3_data.pipeline import run_gate
    from eagle3_data.stages.validate import ValidationSummary, compare_billed_counts

    summary = ValidationSummary()
    summary.counts["exact"] = 3
    gate = run_gate(summary.report(), compare_billed_counts([("s1", 10, 10)]), load_config().validation)
    assert gate.passed and not gate.unvalidated_overflow and gate.reasons == []


def test_bulk_stages_start_on_tiktoken_with_the_hf_hashes(kimi_tokenizer_dir, tmp_path, monkeypatch):
    """reconstruct/validate/merge take the verified tiktoken fast start (no transformers import at
    their start), with the same files and template hashes as the HF tokenizer: a stage's reuse
    params do not depend on which loader a process used. A record from before the template hash
    was recorded is re-verified, not trusted with a missing hash."""
    import json
    import types

    from eagle3_data.codec import TiktokenTokenizer
    from eagle3_data.runs import run as run_mod

    monkeypatch.setenv("EAGLE3_DATA_CACHE", str(tmp_path))
    config = load_config().with_overrides({"tokenizer": {"source": str(kimi_tokenizer_dir)}}, where="test")
    run = run_mod.Run(
        config=config, run_key="k", date=None, datasets=config.dataset_names, dry_run=False, skip_hidden_states=False
    )
    store = types.SimpleNamespace(client=None)
    run_mod._load_bulk_tokenizer.cache_clear()
    hf = run_mod.bulk_tokenizer_for(run, store)  # first start on this host: HF, verifying
    assert not isinstance(hf, TiktokenTokenizer)
    (record_path,) = (tmp_path / "verified-codecs").glob("*.json")
    run_mod._load_bulk_tokenizer.cache_clear()
    fast = run_mod.bulk_tokenizer_for(run, store)
    assert isinstance(fast, TiktokenTokenizer)
    assert run_mod.tokenizer_hashes(fast) == run_mod.tokenizer_hashes(hf)
    assert run_mod.tokenizer_hashes(fast)["template_sha256"] is not None
    monkeypatch.setattr(run_mod, "tokenizer_for", lambda *_: pytest.fail("a bulk stage loaded the HF tokenizer"))
    assert run_mod.output_format(run, store, template=False).codec.encode_batch(["hi"]) == [
        hf.encode("hi", add_special_tokens=False)
    ]
    old = json.loads(record_path.read_text())
    del old["template_sha256"]
    record_path.write_text(json.dumps(old))
    run_mod._load_bulk_tokenizer.cache_clear()
    assert not isinstance(run_mod.bulk_tokenizer_for(run, store), TiktokenTokenizer)
    assert "template_sha256" in json.loads(record_path.read_text())
    run_mod._load_bulk_tokenizer.cache_clear()


@pytest.mark.timeout(180)
def test_validate_stage_runs_its_worker_pool_under_a_host_sigterm_handler(store, kimi_tokenizer_dir, monkeypatch):
    """The DAG's gate forks the same worker pool as `eagle3-data validate` (one per core by
    default), inside a task process that holds its own SIGTERM handler (Airflow's; here one that
    swallows the signal, which hung a pool once). The stage must finish, use the forked pool, and
    leave no worker behind."""
    import multiprocessing
    import signal

    import eagle3_data.mismatch.pool as validate_mod
    from eagle3_data import pipeline
    from eagle3_data.runs.run import Run
    from eagle3_data.stages import LOCAL, PROMPTS, RECONSTRUCT
    from tests.fixtures.kimi import REFERENCE_IDS

    config = load_config().with_overrides({"tokenizer": {"source": str(kimi_tokenizer_dir)}}, where="test")
    dataset = config.dataset_names[0]
    run = Run(config=config, run_key="sigterm", date=None, datasets=[dataset], dry_run=False, skip_hidden_states=False)
    rows = [
        {
            "sample_id": f"s{i}",
            "dataset": dataset,
            "output_ids": REFERENCE_IDS,
            "source": "sglang",
            "status": "ok",
            "finish_reason": "stop",
        }
        for i in range(40)
    ]
    for stage, kind, data in (
        (PROMPTS, "prompts", [{"sample_id": r["sample_id"], "dataset": dataset, "route": "local"} for r in rows]),
        (LOCAL, "generations", rows),
        (RECONSTRUCT, "generations", []),
    ):
        with StageWriter(
            store, pipeline.stage_ref(run, stage, dataset), kind, rows_per_part=64, params={}, fresh=True
        ) as w:
            if data:
                w.write(data)
            w.commit()
    pools = []
    forked = validate_mod._validate_forked
    monkeypatch.setattr(validate_mod, "_validate_forked", lambda *a: (pools.append(a[-1]), (yield from forked(*a))))
    monkeypatch.setattr(
        validate_mod, "_chunks", lambda items, size, _c=validate_mod._chunks: _c(items, 7)
    )  # several chunks
    monkeypatch.setattr("os.cpu_count", lambda: 3)  # the CLI's default: one worker per core
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        result = pipeline.validate(run, store, dataset)  # as the DAG calls it
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert pools == [3]
    assert result.gate.passed and result.counts["exact"] == 40
    assert multiprocessing.active_children() == []


def test_dry_run_plan_lists_each_strategy_and_balanced_routes_finish_together(
    store, kimi_tokenizer_dir, tmp_path, monkeypatch
):
    """The plan (dry run) prints every routing strategy's expected wall time and overflow cost on
    the dataset's samples; with strategy=balanced the routes written are that balanced split."""
    import json

    from eagle3_data import pipeline
    from eagle3_data.runs.run import Run

    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {i}" + " more" * (i % 7)}]}) + "\n"
            for i in range(40)
        )
    )  # prompts of several lengths: the average is not every prompt
    overrides = {
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
    }
    config = load_config().with_overrides(overrides, where="test")
    plan_run = Run(config=config, run_key="plan", date=None, datasets=["chat"], dry_run=True, skip_hidden_states=False)
    plan = pipeline.load_route(plan_run, store, "chat").plan
    strategies = plan["estimate"]["strategies"]
    assert set(strategies) == {"fraction", "capacity", "balanced"}
    assert [n for n, p in strategies.items() if p["chosen"]] == ["balanced"]
    for p in strategies.values():
        assert {"local", "overflow", "local_s", "overflow_s", "wall_s", "overflow_usd"} <= set(p)
    bal = strategies["balanced"]
    # local 2 x 4 / 8 s = 1 sample/s, overflow 12 / 4 s = 3 samples/s: (40 + 2) / 4 = 10.5 local
    assert abs(bal["local_s"] - bal["overflow_s"]) <= 1.0
    assert bal["wall_s"] <= min(p["wall_s"] for p in strategies.values())
    assert plan["counts"].get("local", 0) + plan["counts"].get("both", 0) == bal["local"]
    # one overflow bound for the routes taken: the chosen strategy's is the estimate's (both uncapped here)
    assert bal["overflow_usd"] == plan["estimate"]["max_overflow_usd"] < config.generation.overflow.max_usd
    # the run's plan (publish in a dry run): the same three strategies over all its datasets
    from eagle3_data.stages import PLAN, RUN_DATASET

    pipeline.publish(plan_run, store)
    whole = store.get_json(pipeline.stage_ref(plan_run, PLAN, RUN_DATASET), "plan.json")["strategies"]
    assert {n: (p["local"], p["overflow"], p["wall_s"]) for n, p in whole.items()} == {
        n: (p["local"], p["overflow"], p["wall_s"]) for n, p in strategies.items()
    }


@pytest.mark.parametrize("local_images", [False, True])
def test_image_prompts_go_local_only_when_the_local_endpoints_take_images(
    local_images, store, kimi_tokenizer_dir, tmp_path
):
    """routing.overflow_fraction 0 puts every prompt local; an image prompt stays there only when
    `generation.local.images` says the endpoints take images, else it is moved to overflow, counted."""
    import json

    from eagle3_data import pipeline
    from eagle3_data.runs.run import Run
    from eagle3_devtools.sample_images import png

    (tmp_path / "a.png").write_bytes(png(28, 28, lambda x, y: (x, y, 5)))
    rows = [{"messages": [{"role": "user", "content": "text only"}]}]
    rows.append({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]})
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {
        "tokenizer": {"source": str(kimi_tokenizer_dir)},
        "datasets": [{"name": "chat", "prompts": str(tmp_path / "chat.jsonl")}],
        "generation": {"local": {"images": local_images}},
        "routing": {"strategy": "fraction", "overflow_fraction": 0.0, "calibration_samples": 0},
    }
    config = load_config().with_overrides(overrides, where="test")
    run = Run(
        config=config,
        run_key=f"img-{local_images}",
        date=None,
        datasets=["chat"],
        dry_run=False,
        skip_hidden_states=False,
    )
    counts = pipeline.load_route(run, store, "chat").counts
    if local_images:
        assert counts["local"] == 2 and "overflow" not in counts and "images_to_overflow" not in counts, counts
    else:
        assert counts["local"] == 1 and counts["overflow"] == 1 and counts["images_to_overflow"] == 1, counts


@pytest.mark.parametrize(
    "reason,passes",
    [
        ("rate_limited", True),
        ("in_flight_budget", True),
        ("retryable_failures", True),
        ("forbidden", False),
        ("credits", False),
        ("repeated_error", False),
        ("budget", False),
        ("unauthorized", False),
        ("unpriced_answer", False),
    ],
)
def test_overflow_stops_that_pass_by_themselves_are_retried_the_others_fail(reason, passes, monkeypatch):
    """A 429 storm or the in-flight budget passes: Retryable (Airflow retries the task). A key
    limit, empty credits, a refused parameter or the budget need a person: UserError (the DAG
    fails the task without retries). Either way the message carries the provider's words."""
    from eagle3_data.errors import Retryable, UserError
    from eagle3_data.runs.run import Run
    from eagle3_data.stages.generate import openrouter
    from eagle3_data.stages.generate import stage as gen

    monkeypatch.setattr(gen, "_reused", lambda *a: None)
    monkeypatch.setattr(gen, "_prompt_rows", lambda *a: iter(()))
    monkeypatch.setattr(gen, "output_format", lambda *a, **k: None)
    monkeypatch.setattr(
        openrouter,
        "generate_overflow",
        lambda *a, **k: {
            "uri": "s3://b/x",
            "complete": False,
            "stopped_reason": reason,
            "stop_detail": "the provider's words",
            "counts": {},
            "cost_usd": 0.0,
        },
    )
    config = load_config()
    run = Run(
        config=config, run_key="k", date=None, datasets=config.dataset_names, dry_run=False, skip_hidden_states=False
    )
    with pytest.raises(UserError, match="the provider's words") as raised:
        gen.generate_overflow(run, None, "chat", "http://127.0.0.1:9/v1", "key")
    assert isinstance(raised.value, Retryable) is passes
