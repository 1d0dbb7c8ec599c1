"""One policy-check trial on real engines: the pipeline's stages against a given "provider".

Prompts routed by the pipeline's own routing (half to the overflow provider, `calibration`
prompts greedy on both paths), then `generate_local` on the local `vllm serve`,
`generate_overflow` against the provider's OpenRouter-shaped chat route, `reconstruct`,
`score_policy` (the default policy settings unless `policy` overrides them) and `validate`
(the gate). tests/engine/test_policy_faults.py and benchmarks/policy_power.py run it with the
tiny target behind `eagle3_devtools.provider_proxy`. The sampling has a nucleus (top_p 0.95), so
score_policy counts the scored answers' tokens outside it from the local engine's top-K, as in
production (nucleus), at `top_logprobs` a position: the tiny target's distributions are
far flatter than a trained model's, and the nucleus test sees them only with K in the hundreds
(`vllm_serve.MAX_LOGPROBS`, which the launcher allows), and with the fp32 logit margin
(`policy.nucleus_logit_margin`): both sides' engines are one fp32 server.
"""

from __future__ import annotations

import json
from typing import Any

from eagle3_devtools.vllm_serve import MAX_LOGPROBS, SERVED_MODEL_NAME

DATASET = "policy"


def trial_run(
    tokenizer_dir,
    run_key: str,
    *,
    max_new_tokens: int,
    sampling_seed: int,
    policy: dict | None = None,
    top_logprobs: int = MAX_LOGPROBS,
):
    """The run's config: the defaults, the tiny target's served name as the pinned overflow
    model, the sampling fixed by `sampling_seed` (the same text for the same seed), the scoring
    requests asking for `top_logprobs` a position (`policy.top_logprobs`; `policy` overrides more)."""
    from eagle3_data.config import load_config
    from eagle3_data.nucleus import LOGIT_MARGIN
    from eagle3_data.runs.run import Run

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
            # the local engine and the provider are one fp32 vLLM server here: their logits differ by
            # ~1e-5 (target_head.logprobs), so the nucleus rule's margin is fp32's, not a bf16 deployment's
            "policy": {"top_logprobs": top_logprobs, "nucleus_logit_margin": LOGIT_MARGIN["float32"], **(policy or {})},
            "datasets": [{"name": DATASET}],
        },
        where="policy trial",
    )
    return Run(config=config, run_key=run_key, date=None, datasets=[DATASET], dry_run=False, skip_hidden_states=True)


def write_prompts(store, run, samples: int, calibration: int) -> dict[str, str]:
    """`samples` prompts, routed as the prompts stage routes them (fraction 0.5, `calibration`
    of them on both paths); returns the routes."""
    from eagle3_data.config import RoutingConfig
    from eagle3_data.runs.run import stage_ref
    from eagle3_data.stages import PROMPTS
    from eagle3_data.stages.prompts.routing import assign_routes
    from eagle3_data.storage.writer import StageWriter

    ids = [f"p{i:04d}" for i in range(samples)]
    routes = assign_routes(ids, RoutingConfig(overflow_fraction=0.5, calibration_samples=calibration))
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


def run_trial(store, run, local_url: str, provider_url: str, *, samples: int, calibration: int = 0) -> dict[str, Any]:
    """The stages through the gate; returns the gate's verdict (`passed`, `reasons`, `notes`),
    the committed policy figures (`figures`, with `sizing`) and the decision on them."""
    from eagle3_data import pipeline
    from eagle3_data.errors import GateFailed
    from eagle3_data.policy_check import Thresholds, decide_figures
    from eagle3_data.runs.upstream import policy_summary

    write_prompts(store, run, samples, calibration)
    pipeline.generate_local(run, store, DATASET, [local_url])
    pipeline.generate_overflow(run, store, DATASET, provider_url + "/v1", "key-unused-by-vllm")
    pipeline.reconstruct(run, store, DATASET)
    pipeline.score_policy(run, store, DATASET, [local_url])
    try:
        gate = pipeline.validate(run, store, DATASET).gate
        verdict = {"passed": gate.passed, "reasons": list(gate.reasons), "notes": list(gate.notes)}
    except GateFailed as failed:
        verdict = {"passed": False, "reasons": [str(failed)], "notes": []}
    figures = policy_summary(run, store, DATASET)
    th = Thresholds.from_config(run.config.dataset(DATASET).validation)
    return {**verdict, "figures": figures, "decision": decide_figures(figures, th)}
