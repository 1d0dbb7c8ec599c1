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

CPU cost: on the session's engine, two trials of 192 prompts x 48 tokens and one of 64 x 32
(generation on both paths, then scoring): ~21k generated tokens in all.
"""

from __future__ import annotations

import pytest
from eagle3_devtools.policy_trial import run_trial, trial_run
from eagle3_devtools.provider_proxy import Rewrite, start_provider_proxy

# one LARGE trial is ~10k generated tokens and 192 scoring requests: 11 minutes measured on two
# cores shared with other engineers' engines (2026-12-03, vLLM at ~25 tokens/s): past the suite's
# 600 s default
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CALIBRATION = 4  # of the local half, greedy on both paths (pairs)
# (prompts, max_new_tokens): half the prompts to the provider. Ignoring top_p moves the overflow
# text by ~0.45 nats/token, and a sample's mean log-probability spreads by ~0.55 at 48 tokens
# (RESULTS.md, "Policy check against faulty providers"): 192 prompts (92 + 96 sampled answers)
# put it ~5 standard errors beyond the tolerance; the honest trial runs at the same size. A
# temperature of 1.3 moves it by ~2 nats/token: seen at a fraction of that.
LARGE, SMALL = (192, 48), (64, 32)


def _trial(store, vllm_server, kimi_tokenizer_dir, name: str, rewrite: Rewrite, size: tuple[int, int]) -> dict:
    prompts, max_new_tokens = size
    proxy = start_provider_proxy(vllm_server.url, rewrite)
    try:
        run = trial_run(kimi_tokenizer_dir, f"policy-fault-{name}", max_new_tokens=max_new_tokens, sampling_seed=7)
        trial = run_trial(store, run, vllm_server.url, proxy.url, samples=prompts, calibration=CALIBRATION)
    finally:
        proxy.stop()
    overflow = prompts // 2
    if rewrite == Rewrite():
        assert proxy.rewritten == 0
    else:  # every sampled request served with the fault (greedy calibration ones: top_p dropped, temperature 0 kept)
        assert proxy.rewritten >= overflow, proxy.rewritten
    sampled = trial["decision"]["tests"]["sampled"]
    assert sampled["samples"] == [overflow - CALIBRATION, overflow], sampled  # every sampled answer scored
    print(f"policy trial {name} ({prompts} x {max_new_tokens}): shift {sampled['shift']:+.3f} +- "
          f"{sampled['standard_error']:.3f} nats/token, p {sampled['p_value']:.2g}, min detectable shift "
          f"{sampled['min_detectable_shift']:.3f}, gate {'passed' if trial['passed'] else 'failed'}")
    return trial


@pytest.mark.parametrize("name,rewrite,size", [
    ("temperature-1.3", Rewrite(temperature_factor=1.3), SMALL),
    ("top_p-ignored", Rewrite(ignore=("top_p",)), LARGE),
])
def test_provider_ignoring_sampling_fails(store, vllm_server, kimi_tokenizer_dir, name, rewrite, size):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, name, rewrite, size)
    sampled = trial["decision"]["tests"]["sampled"]
    assert not trial["passed"], trial["notes"]
    # a flatter sampler's text is less likely under the target than the target's own
    assert [r for r in trial["reasons"] if "policy: overflow text is off the target's policy, less likely" in r], trial
    assert sampled["rejected"] and sampled["shift"] > sampled["critical_shift"], sampled
    assert "identity" not in " ".join(trial["reasons"])  # same served name, same weights: only policy can tell


def test_honest_provider_passes(store, vllm_server, kimi_tokenizer_dir):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "honest", Rewrite(), LARGE)
    sampled = trial["decision"]["tests"]["sampled"]
    assert trial["passed"], trial["reasons"]
    assert not sampled["rejected"] and sampled["p_value"] > 0.01, sampled
    assert abs(sampled["shift"]) < 3 * sampled["standard_error"] + 0.05, sampled  # centred on zero
    power = next(n for n in trial["notes"] if n.startswith("policy power: sampled answers"))
    assert "UNDERPOWERED" in power, power  # at 92 + 96 the shift that matters (0.1) is out of sight: said
