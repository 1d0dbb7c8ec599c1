"""A provider serving the target's weights but not its sampling fails the policy gate; an honest one passes.

The local engine is the session's `vllm serve` of the tiny target; the provider is the same
engine behind eagle3_devtools.provider_proxy (OpenRouter's chat route forwarded byte for byte),
which (a) samples at 1.3 when asked 1.0, (b) drops `top_p` (0.95 asked), or (honest) changes
nothing. Each trial runs the pipeline's stages (eagle3_devtools.policy_trial: routing half the
prompts to the provider, both generations, reconstruction, score_policy, validate) at the
default policy settings: the pilot of 32 a side sizes the sample from its spread, capped by the
answers there are. What these sizes can see is stated by the decision itself (its minimum
detectable shift) and asserted below: the faults' shifts are well above it, the default shift
that matters (0.1 nats/token) is not reached (benchmarks/policy_power.py and RESULTS.md give
the figures at larger sizes).

CPU cost: three trials of PROMPTS prompts x MAX_NEW_TOKENS tokens on the session's engine
(generation and scoring), about a minute each on two idle cores.
"""

from __future__ import annotations

import pytest
from eagle3_devtools.policy_trial import run_trial, trial_run
from eagle3_devtools.provider_proxy import Rewrite, start_provider_proxy

pytestmark = pytest.mark.slow

PROMPTS = 96  # 48 to the provider, 4 of the local half greedy on both paths
CALIBRATION = 4
MAX_NEW_TOKENS = 48


def _trial(store, vllm_server, kimi_tokenizer_dir, name: str, rewrite: Rewrite) -> dict:
    proxy = start_provider_proxy(vllm_server.url, rewrite)
    try:
        run = trial_run(kimi_tokenizer_dir, f"policy-fault-{name}", max_new_tokens=MAX_NEW_TOKENS, sampling_seed=7)
        trial = run_trial(store, run, vllm_server.url, proxy.url, samples=PROMPTS, calibration=CALIBRATION)
    finally:
        proxy.stop()
    overflow = PROMPTS // 2
    assert proxy.rewritten == (0 if rewrite == Rewrite() else overflow), proxy.rewritten  # the fault was served
    sampled = trial["decision"]["tests"]["sampled"]
    assert sampled["samples"] == [overflow - CALIBRATION, overflow], sampled  # every sampled answer scored
    return trial


def test_honest_provider_passes(store, vllm_server, kimi_tokenizer_dir):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "honest", Rewrite())
    sampled = trial["decision"]["tests"]["sampled"]
    assert trial["passed"], trial["reasons"]
    assert not sampled["rejected"] and sampled["p_value"] > 0.01, sampled
    assert abs(sampled["shift"]) < 3 * sampled["standard_error"] + 0.05, sampled  # centred on zero
    power = next(n for n in trial["notes"] if n.startswith("policy power: sampled answers"))
    assert "UNDERPOWERED" in power, power  # at 44 + 48 the shift that matters (0.1) is out of sight: said


@pytest.mark.parametrize("name,rewrite,sign", [
    ("temperature-1.3", Rewrite(temperature_factor=1.3), "less likely"),
    ("top_p-ignored", Rewrite(ignore=("top_p",)), "less likely"),
])
def test_provider_ignoring_sampling_fails(store, vllm_server, kimi_tokenizer_dir, name, rewrite, sign):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, name, rewrite)
    sampled = trial["decision"]["tests"]["sampled"]
    assert not trial["passed"], trial["notes"]
    assert [r for r in trial["reasons"] if f"policy: overflow text is off the target's policy, {sign}" in r], trial
    assert sampled["rejected"] and sampled["shift"] > sampled["min_detectable_shift"], sampled
    assert "identity" not in " ".join(trial["reasons"])  # same served name, same weights: only policy can tell
