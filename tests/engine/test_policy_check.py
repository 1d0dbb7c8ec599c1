"""The policy check tells a different model from the target, on CPU, with the real local engine.

The local engine is the session's `vllm serve` of the tiny Kimi-K2.5 (peaked next-token
distributions, so a model's text is its own). The overflow "provider" is the session's dev
inference server (the OpenRouter stand-in; its text comes from eagle3_data.dev.text_model's
seeded corpus, not from the target) answering OpenRouter's chat route under the pinned served
name -> the identity check cannot see it (same name), the policy check fails the dataset naming
the figures. (Until 2026-12-04 a second `vllm serve` with other weights played this provider: the test
took 72 CPU s with it, ~50 of them its start-up, for the same verdict; `make test`'s row in RESULTS.md.) The same
weights passing, with the power statement, is tests/engine/test_policy_faults.py's honest
provider (not run twice); other weights that stay in the target's nucleus are the greedy test's,
benchmarks/policy_power.py's int8 provider. Each run goes through the pipeline's own stages:
prompts, both generations, reconstruction, scoring (default policy settings: the pilot takes all
24 answers a side), the gate. 24 samples a side cannot see the default shift that matters (0.1
nats/token) with 90% power: the gate says so and still fails another model's text (its shift is
ten times that).
"""

from __future__ import annotations

import json

import pytest

from eagle3_data.config import load_config
from eagle3_data.errors import GateFailed
from eagle3_data.runs.run import Run
from eagle3_data.stages import PROMPTS
from eagle3_data.storage.writer import StageWriter
from eagle3_devtools.vllm_serve import SERVED_MODEL_NAME

pytestmark = pytest.mark.slow

DATASET = "policy"
SAMPLES = 48  # 24 local, 24 overflow


def _run(kimi_tokenizer_dir, run_key: str) -> Run:
    config = load_config().with_overrides(
        {
            "tokenizer": {"source": str(kimi_tokenizer_dir)},
            "generation": {
                "sampling": {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 7},  # the same text every run
                "local": {"engine": "vllm", "rows_per_part": 64},
                # vLLM answers without usage.cost: priced from the config, the budget still binds
                # fallbacks allowed: any provider (a vLLM server names none); the model's name is checked
                "overflow": {
                    "model": SERVED_MODEL_NAME,
                    "provider": {"allow_fallbacks": True},
                    "concurrency": 8,
                    "price_usd_per_mtok": {"prompt": 1.0, "completion": 1.0},
                },
            },
            # a random model's text is rarely its tokenizer's canonical split, and re-splits move the
            # billed count: measured and reported here, not what this test is about
            "validation": {"max_bpe_mismatch_rate": 1.0, "max_billing_deviation": 1.0},
            "datasets": [{"name": DATASET}],
        },
        where="test",
    )
    return Run(config=config, run_key=run_key, date=None, datasets=[DATASET], dry_run=False, skip_hidden_states=True)


def _prompts(store, run: Run) -> None:
    rows = [
        {
            "sample_id": f"p{i:03d}",
            "dataset": DATASET,
            "sample_index": i,
            "source_id": None,
            "messages": json.dumps([{"role": "user", "content": f"Tell me about city number {i}."}]),
            "tools": None,
            "route": "overflow" if i % 2 else "local",
        }
        for i in range(SAMPLES)
    ]
    with StageWriter(store, run_ref(run, PROMPTS), "prompts", rows_per_part=64) as w:
        w.write(rows)
        w.commit()


def run_ref(run: Run, stage: str):
    from eagle3_data.runs.run import stage_ref

    return stage_ref(run, stage, DATASET)


def _through_the_gate(store, run: Run, local_url: str, provider_url: str):
    from eagle3_data import pipeline

    _prompts(store, run)
    pipeline.generate_local(run, store, DATASET, [local_url])
    pipeline.generate_overflow(run, store, DATASET, provider_url + "/v1", "key-unused-by-vllm")
    pipeline.reconstruct(run, store, DATASET)
    policy = pipeline.score_policy(run, store, DATASET, [local_url])
    assert policy.scored == {"local": 24, "overflow": 24}, policy
    return policy, lambda: pipeline.validate(run, store, DATASET)


def test_another_models_text_under_the_same_name_fails(store, vllm_server, start_dev_server, kimi_tokenizer_dir):
    provider = start_dev_server({"model": SERVED_MODEL_NAME, "canonical_slug": SERVED_MODEL_NAME})
    policy, validate = _through_the_gate(store, _run(kimi_tokenizer_dir, "policy-other"), vllm_server.url, provider.url)
    assert policy.gap_nats_per_token > 1.0, policy  # far less likely under the target than its own text
    with pytest.raises(GateFailed, match="policy: overflow text is off the target's policy, less likely") as failed:
        validate()
    print(f"another model's text (the dev server under the pinned name): {failed.value}")
    assert "identity" not in str(failed.value)  # same served name: only the policy check can tell
    assert "sampled answers: mean log-probability" in str(failed.value) and "over 24 + 24 samples" in str(failed.value)
