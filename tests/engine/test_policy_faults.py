"""Providers serving the target's weights but not its sampling, against the policy gate, on CPU.

The local engine is the session's `vllm serve` of the tiny target; the provider is the same
engine behind eagle3_devtools.provider_proxy (OpenRouter's chat route forwarded byte for byte),
which (a) samples at 1.3 when asked 1.0, (b) drops `top_p` (0.95 asked), or (honest) changes
nothing. Each trial runs the pipeline's stages (eagle3_devtools.policy_trial: routing half the
prompts to the provider, both generations, reconstruction, score_policy, validate) at the
default policy settings: the pilot of 32 a side sizes the sample from its spread, capped by the
answers there are. (a) fails the gate. (b) is below what a CPU-sized run lets the check see (its
stated minimum detectable shift is larger than the fault's shift) and the check says so: its
test asserts the fault is never passed silently, not that it fails; the gate is not weakened.
Honest passes. Each trial is 64 prompts x 32 tokens (~3.5k generated tokens, both paths, then
scoring), so the three cost about what one 192-prompt trial does; benchmarks/policy_power.py
runs them at 192 prompts and more seeds (RESULTS.md, "Policy check against faulty providers").
"""

from __future__ import annotations

import pytest

from eagle3_devtools.policy_trial import run_trial, trial_run
from eagle3_devtools.provider_proxy import Rewrite, start_provider_proxy

# a trial took 2-5 minutes on two cores shared with other engines (2026-12-03): past the suite's 600 s
# default when the machine is crowded
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CALIBRATION = 4  # of the local half, greedy on both paths (pairs)
# (prompts, max_new_tokens): half the prompts to the provider. A temperature of 1.3 moves the
# overflow text by ~2 nats/token: seen at this size. Ignoring top_p moves it by ~0.3-0.45 with a
# per-sample spread of ~0.55-0.87 (RESULTS.md, "Policy check against faulty providers"): not
# seen even at 192 prompts (benchmarks/policy_power.py).
SMALL = (64, 32)


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
    print(
        f"policy trial {name} ({prompts} x {max_new_tokens}): shift {sampled['shift']:+.3f} +- "
        f"{sampled['standard_error']:.3f} nats/token, p {sampled['p_value']:.2g}, min detectable shift "
        f"{sampled['min_detectable_shift']:.3f}, gate {'passed' if trial['passed'] else 'failed'}"
    )
    return trial


def test_provider_sampling_at_another_temperature_fails(store, vllm_server, kimi_tokenizer_dir):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "temperature-1.3", Rewrite(temperature_factor=1.3), SMALL)
    sampled = trial["decision"]["tests"]["sampled"]
    assert not trial["passed"], trial["notes"]
    # a flatter sampler's text is less likely under the target than the target's own
    assert [r for r in trial["reasons"] if "policy: overflow text is off the target's policy, less likely" in r], trial
    assert sampled["rejected"] and sampled["shift"] > sampled["critical_shift"], sampled
    assert "identity" not in " ".join(trial["reasons"])  # same served name, same weights: only policy can tell


def test_provider_ignoring_top_p_fails_or_the_check_says_it_cannot_see_it(store, vllm_server, kimi_tokenizer_dir):
    """Ignoring top_p 0.95 moves the tiny model's text by ~0.26-0.45 nats/token against a
    per-sample spread of ~0.55-0.87: even at 192 prompts the check's stated minimum detectable shift
    (0.67 when measured) is above it, so the gate cannot fail it at the default settings
    (RESULTS.md; ~800 samples a side would). What must hold at any size: the fault is never
    passed silently: either the gate fails it on policy, or its power statement says it could
    not see a shift this large (the shift it measured is below the one it states it detects,
    and the gate notes UNDERPOWERED). The gate is not weakened to make it fail."""
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "top_p-ignored", Rewrite(ignore=("top_p",)), SMALL)
    sampled = trial["decision"]["tests"]["sampled"]
    if sampled["rejected"]:
        assert [r for r in trial["reasons"] if "policy: overflow text is off the target's policy, less likely" in r]
    else:
        assert trial["passed"] and sampled["shift"] < sampled["min_detectable_shift"], sampled
        assert any(n.startswith("policy UNDERPOWERED") for n in trial["notes"]), trial["notes"]


def test_honest_provider_passes(store, vllm_server, kimi_tokenizer_dir):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "honest", Rewrite(), SMALL)
    sampled = trial["decision"]["tests"]["sampled"]
    assert trial["passed"], trial["reasons"]
    assert not sampled["rejected"] and sampled["p_value"] > 0.01, sampled
    assert abs(sampled["shift"]) < 3 * sampled["standard_error"] + 0.05, sampled  # centred on zero
    power = next(n for n in trial["notes"] if n.startswith("policy power: sampled answers"))
    assert "UNDERPOWERED" in power, power  # at 28 + 32 the shift that matters (0.1) is out of sight: said
