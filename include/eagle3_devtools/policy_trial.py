"""One policy-check trial on real engines: the pipeline's stages against a given "provider".

Prompts routed by the pipeline's own routing (half to the overflow provider, `calibration`
prompts greedy on both paths), then `generate_local` on the local `vllm serve`,
`generate_overflow` against the provider's OpenRouter-shaped chat route, `reconstruct`,
`score_policy` (the default policy settings unless `policy` overrides them) and `validate`
(the gate). tests/engine/test_policy_faults.py and benchmarks/policy_power.py run it with the
tiny target behind `eagle3_devtools.provider_proxy`. With `backend` (the target as a hidden-state
backend: the extraction's), score_policy also counts the scored answers' tokens outside the
sampling's nucleus and the gate runs the nucleus test (policy.nucleus, policy.compare).
"""

from __future__ import annotations

import json
from typing import Any

DATASET = "policy"
SERVED_MODEL_NAME = "tiny-kimi"  # eagle3_devtools.vllm_serve's


def trial_run(tokenizer_dir, run_key: str, *, max_new_tokens: int, sampling_seed: int, policy: dict | None = None):
    """The run's config: the defaults, the tiny target's served name as the pinned overflow
    model, the sampling fixed by `sampling_seed` (the same text for the same seed)."""
    from eagle3_data.config import load_config
    from eagle3_data.pipeline.run import Run

    config = load_config().with_overrides(
        {
            "tokenizer": {"source": str(tokenizer_dir)},
            "generation": {
                "sampling": {
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "max_new_tokens": max_new_tokens,
                    "sampling_seed": sampling_seed,
                },
                "local": {"engine": "vllm", "rows_per_part": 256},
                # vLLM answers without usage.cost: priced from the config; any provider (a vLLM server
                # names none), the model's name is checked
                "overflow": {
                    "model": SERVED_MODEL_NAME,
                    "provider": {"allow_fallbacks": True},
                    "concurrency": 16,
                    "price_usd_per_mtok": {"prompt": 1.0, "completion": 1.0},
                },
            },
            # a random model's text is rarely its tokenizer's canonical split and re-splits move the
            # billed count: measured elsewhere, not what a policy trial is about
            "validation": {"max_bpe_mismatch_rate": 1.0, "max_billing_deviation": 1.0},
            **({"policy": policy} if policy else {}),
            "datasets": [{"name": DATASET}],
        },
        where="policy trial",
    )
    return Run(config=config, run_key=run_key, date=None, datasets=[DATASET], dry_run=False, skip_hidden_states=True)


def write_prompts(store, run, samples: int, calibration: int) -> dict[str, str]:
    """`samples` prompts, routed as the prompts stage routes them (fraction 0.5, `calibration`
    of them on both paths); returns the routes."""
    from eagle3_data.generation.routing import assign_routes
    from eagle3_data.pipeline.run import stage_ref
    from eagle3_data.stages import PROMPTS
    from eagle3_data.storage.writer import StageWriter

    ids = [f"p{i:04d}" for i in range(samples)]
    routes = assign_routes(ids, overflow_fraction=0.5, calibration_samples=calibration)
    rows = [
        {
            "sample_id": sid,
            "dataset": DATASET,
            "sample_index": i,
            "source_id": None,
            "messages": json.dumps([{"role": "user", "content": f"Tell me about city number {i}."}]),
            "tools": None,
            "route": route,
        }
        for i, (sid, route) in enumerate(zip(ids, routes))
    ]
    with StageWriter(store, stage_ref(run, PROMPTS, DATASET), "prompts", rows_per_part=1024) as w:
        w.write(rows)
        w.commit()
    return dict(zip(ids, routes))


def run_trial(
    store, run, local_url: str, provider_url: str, *, samples: int, calibration: int = 0, backend=None
) -> dict[str, Any]:
    """The stages through the gate; returns the gate's verdict (`passed`, `reasons`, `notes`),
    the committed policy figures (`figures`, with `sizing`) and the decision on them."""
    from eagle3_data import pipeline
    from eagle3_data.errors import GateFailed
    from eagle3_data.pipeline.policy import policy_summary
    from eagle3_data.policy.compare import Thresholds, decide_figures

    write_prompts(store, run, samples, calibration)
    pipeline.generate_local(run, store, DATASET, [local_url])
    pipeline.generate_overflow(run, store, DATASET, provider_url + "/v1", "key-unused-by-vllm")
    pipeline.reconstruct(run, store, DATASET)
    pipeline.score_policy(run, store, DATASET, [local_url], backend=backend)
    try:
        gate = pipeline.validate(run, store, DATASET).gate
        verdict = {"passed": gate.passed, "reasons": list(gate.reasons), "notes": list(gate.notes)}
    except GateFailed as failed:
        verdict = {"passed": False, "reasons": [str(failed)], "notes": []}
    figures = policy_summary(run, store, DATASET)
    th = Thresholds.from_config(run.config.dataset(DATASET).validation)
    return {**verdict, "figures": figures, "decision": decide_figures(figures, th)}
