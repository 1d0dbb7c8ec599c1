"""The probe as the DAG runs it: after the extraction's commit it reads the extraction's shards
and the merge's draft vocabulary from S3, trains speculators' head, writes probe.json beside a
manifest, is reused on a rerun, and publish reads its figures and curve for the report. Under the
default `auto` a worker without a GPU (this one) skips it, saying why, but still reports a probe
that ran on the same extraction; `never` is off. Its target
is the packaged default's, the tiny Kimi-K2.5: speculators reads a vision-language verifier's
sizes from its `text_config` and its weights under `language_model.`."""

from __future__ import annotations

import dataclasses

import pytest

from eagle3_data.config import MergeConfig, load_config
from eagle3_data.storage import StageRef
from tests.fixtures.kimi import VOCAB_SIZE
from tests.integration.test_extract_s3 import RUN, generations  # noqa: F401  (fixture)


def test_probe_stage_after_the_extraction(store, generations, tiny_kimi_k25_dir, monkeypatch):
    from eagle3_data import pipeline
    from eagle3_data.runs.results import ProbeSkipped
    from eagle3_data.runs.run import Run
    from eagle3_data.stages.merge.datasets import merge_datasets
    from eagle3_data.stages.probe.drafter import simulated_acceptance
    from eagle3_data.stages.publish.stage import _probe_figures

    config = load_config().with_overrides(
        {
            "model": {"source": str(tiny_kimi_k25_dir)},  # the default's dev:tiny-kimi-k25, in the fixtures' cache
            "merge": {"max_length": 40},
            "probe": {"when": "always", "samples": 12, "eval_samples": 4, "steps": 3, "eval_every": 3, "max_len": 256},
        },
        where="test",
    )
    run = Run(
        config=config, run_key=RUN, date=None, datasets=config.dataset_names, dry_run=False, skip_hidden_states=False
    )
    merge_datasets(store, generations, RUN, MergeConfig(shard_tokens=200, max_length=40), vocab_size=VOCAB_SIZE)
    for work in pipeline.plan_hidden_states(run, store):
        pipeline.extract_hidden_states(run, store, work)
    hs = pipeline.commit_hidden_states(run, store)

    auto = dataclasses.replace(run, config=config.with_overrides({"probe": {"when": "auto"}}, where="test"))
    skipped = pipeline.probe(auto, store)  # no GPU here: auto skips before reading a shard, saying why
    assert isinstance(skipped, ProbeSkipped) and "no GPU" in skipped.reason and "probe=always" in skipped.reason
    assert not store.is_complete(StageRef(RUN, "probe", "all"))
    with monkeypatch.context() as m:  # a GPU worker whose first steps pace past the budget (the seam faked)
        import eagle3_data.stages.probe.drafter as probe_lib

        def over(*args, **kwargs):
            raise probe_lib.OverBudget("probe: 200 steps would take ~4000 s on cuda ..., past probe.budget_s 1800")

        m.setattr(probe_lib, "default_device", lambda: "cuda")
        m.setattr(probe_lib, "probe_export", over)
        paced = pipeline.probe(auto, store)  # auto: skipped, saying why; always: the task fails, one line
        assert isinstance(paced, ProbeSkipped) and paced.reason.startswith("probe.when auto: probe: 200 steps")
        with pytest.raises(probe_lib.OverBudget, match="past probe.budget_s 1800"):
            pipeline.probe(run, store)
    assert not store.is_complete(StageRef(RUN, "probe", "all"))

    result = pipeline.probe(run, store)
    ref = StageRef(RUN, "probe", "all")
    report = store.get_json(ref, "probe.json")
    assert result.uri == store.uri(ref, "probe.json") and not result.reused
    assert (
        result.simulated_acceptance
        == report["simulated_acceptance"]
        == pytest.approx(simulated_acceptance(report["acc"]))
    )
    assert len(report["acc"]) == 3 and [c["step"] for c in report["curve"]] == [0, 3]
    rows = report["export_samples"]  # the first shards' rows: at least train + held-out, not all 20 when they suffice
    assert 16 <= rows <= 20 and report["eval_samples"] == min(4, rows // 5) and report["train_samples"] == 12
    assert report["draft_vocab_size"] == config.merge.draft_vocab_size
    assert [i["uri"] for i in store.read_manifest(ref)["inputs"]] == [hs["uri"]]
    # the verdict: the probe's export checked through speculators' reader against the extraction in S3
    assert report["export_check"]["verdict"] == "pass" and report["export_check"]["rows_checked"] == 8
    assert report["verdict"] == result.verdict == "pass" and "export check passed" in report["verdict_rule"]
    assert len(report["seed_runs"]) == config.probe.seeds == 2 and report["data_quality"]["spread"] is not None

    again = pipeline.probe(run, store)  # same extraction, same params: reused, nothing retrained
    assert again.reused and again.simulated_acceptance == result.simulated_acceptance
    shown = _probe_figures(run, store, StageRef(RUN, "hidden_states", "all"))
    assert shown["curve"] == report["curve"] and shown["acc"] == report["acc"]
    assert shown["eval_loss"] == report["eval_loss"] == report["curve"][-1]["eval_loss"] > 0
    assert shown["first_draft"] == report["first_draft"]
    assert shown["last_state_fit"] == report["last_state_fit"] and report["last_state_fit"]["tokens"] > 0
    assert report["first_draft"]["positions"] == report["eval_samples"]  # one answer per held-out sample here
    # the probe that ran on this extraction is the verdict under auto too (reused, not retrained);
    # never hides it
    assert pipeline.probe(auto, store).reused and _probe_figures(auto, store, StageRef(RUN, "hidden_states", "all"))
    never = dataclasses.replace(run, config=config.with_overrides({"probe": {"when": "never"}}, where="test"))
    assert isinstance(pipeline.probe(never, store), ProbeSkipped)
    assert _probe_figures(never, store, StageRef(RUN, "hidden_states", "all")) is None
