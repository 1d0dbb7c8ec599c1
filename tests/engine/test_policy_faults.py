"""Providers serving the target's weights but not its sampling, against the policy gate, on CPU.

The local engine is the session's `vllm serve` of the tiny target; the provider is the same
engine behind eagle3_devtools.provider_proxy (OpenRouter's chat route forwarded byte for byte),
which (a) samples at 1.3 when asked 1.0, (b) drops `top_p` (0.95 asked), or (honest) changes
nothing. Each trial runs the pipeline's stages (eagle3_devtools.policy_trial: routing half the
prompts to the provider, both generations, reconstruction, score_policy, validate) at the
default policy settings, on the production route: no target in memory, score_policy's requests
to the session's `vllm serve` also ask for the top log-probabilities at every position
(`prompt_logprobs`, policy_trial's `top_logprobs`: the tiny target's nucleus holds hundreds of
ids, so K = 1000 where a trained model's needs ~20; trial (a) asks the default 20), and the
answer tokens provably outside the sampling's nucleus are counted from them (nucleus, at
the fp32 logit margin: the local engine and the provider are one fp32 server), so the gate runs
the nucleus test.

(a) fails the gate (its text is ~2 nats/token less likely). (b) is below what the mean test can
see at a CPU-sized run (benchmarks/policy_power.py); the nucleus test
sees it directly: a provider ignoring top_p 0.95 emits tokens outside the nucleus about 5% of the
time, an honest one as often as the local engine (both sides' ids went through one tokenisation
path, so re-split tokens weigh alike). Honest passes. Each trial is 40 prompts x 32 tokens.
"""

from __future__ import annotations

import pytest

from eagle3_devtools.policy_trial import run_trial, trial_run
from eagle3_devtools.provider_proxy import Rewrite, start_provider_proxy

# a trial took 2-5 minutes on two cores shared with other engines (2026-12-03): past the suite's 600 s
# default when the machine is crowded
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CALIBRATION = 4  # of the local half, greedy on both paths (pairs)
# (prompts, max_new_tokens): half the prompts to the provider, ~640 overflow and ~510 local answer tokens
# for the nucleus test. Dropping top_p 0.95 raised the overflow outside-rate from the local 0.8% to 5.1%
# (p 9.2e-6 at this size, seed 7; the same counts from the engine's top-1000 as from the target in memory)
# and from 8.4% to 18.9% at 64 x 32, seed 100 (benchmarks/policy_power.py): re-split tokens fall
# outside on both paths alike, at a rate that varies with the text.
SMALL = (40, 32)


def _trial(store, vllm_server, kimi_tokenizer_dir, name: str, rewrite: Rewrite, **run_options) -> dict:
    """`run_options`: trial_run's keywords beyond the trials' shared size and seed."""
    prompts, max_new_tokens = SMALL
    proxy = start_provider_proxy(vllm_server.url, rewrite)
    try:
        run = trial_run(
            kimi_tokenizer_dir,
            f"policy-fault-{name}",
            max_new_tokens=max_new_tokens,
            sampling_seed=7,
            **run_options,
        )
        trial = run_trial(store, run, vllm_server.url, proxy.url, samples=prompts, calibration=CALIBRATION)
    finally:
        proxy.stop()
    overflow = prompts // 2
    if rewrite == Rewrite():
        assert proxy.rewritten == 0
    else:  # every sampled request served with the fault (greedy calibration ones: top_p dropped, temperature 0 kept)
        assert proxy.rewritten >= overflow, proxy.rewritten
    sampled, nucleus = trial["decision"]["tests"]["sampled"], trial["decision"]["tests"]["nucleus"]
    assert sampled["samples"] == [overflow - CALIBRATION, overflow], sampled  # every sampled answer scored
    assert trial["figures"]["nucleus"]["overflow"]["samples"] == overflow, trial["figures"]["nucleus"]
    (n, m), (a, b) = nucleus["tokens"], nucleus["outside"]
    print(
        f"policy trial {name} ({prompts} x {max_new_tokens}): shift {sampled['shift']:+.3f} +- "
        f"{sampled['standard_error']:.3f} nats/token, p {sampled['p_value']:.2g}, min detectable shift "
        f"{sampled['min_detectable_shift']:.3f}; nucleus outside local {a}/{n}, overflow {b}/{m}, "
        f"p {nucleus['p_value']:.2g}, min detectable rate {nucleus['min_detectable_rate']}; "
        f"gate {'passed' if trial['passed'] else 'failed'}"
    )
    return trial


def test_provider_sampling_at_another_temperature_fails(store, vllm_server, kimi_tokenizer_dir):
    """At the production default of top log-probabilities a position (20, not the 1000 the nucleus
    test needs on the tiny target): the mean test needs only each answer token's own
    log-probability, and the 1000-wide answers cost this trial ~25 of its CPU seconds
    (`make test`'s row in benchmarks/RESULTS.md)."""
    from eagle3_data.config import PolicyConfig

    top = PolicyConfig.model_fields["top_logprobs"].default
    trial = _trial(
        store, vllm_server, kimi_tokenizer_dir, "temperature-1.3", Rewrite(temperature_factor=1.3), top_logprobs=top
    )
    sampled = trial["decision"]["tests"]["sampled"]
    assert not trial["passed"], trial["notes"]
    # a flatter sampler's text is less likely under the target than the target's own
    assert [r for r in trial["reasons"] if "policy: overflow text is off the target's policy, less likely" in r], trial
    assert sampled["rejected"] and sampled["shift"] > sampled["critical_shift"], sampled
    assert "identity" not in " ".join(trial["reasons"])  # same served name, same weights: only policy can tell


def test_provider_ignoring_top_p_fails_on_the_nucleus(store, vllm_server, kimi_tokenizer_dir):
    """The mean test cannot see this fault at this size (its stated minimum detectable shift is
    above the fault's ~0.3 nats/token); the nucleus test fails it: the overflow answers leave the
    nucleus far more often than the local engine's, on the same tokenisation path."""
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "top_p-ignored", Rewrite(ignore=("top_p",)))
    nucleus = trial["decision"]["tests"]["nucleus"]
    assert not trial["passed"], trial["notes"]
    assert "nucleus" in trial["decision"]["rejected"] and nucleus["rates"][1] > nucleus["rates"][0], nucleus
    assert [r for r in trial["reasons"] if "tokens outside the nucleus its sampling allows" in r], trial["reasons"]


def test_honest_provider_passes(store, vllm_server, kimi_tokenizer_dir):
    trial = _trial(store, vllm_server, kimi_tokenizer_dir, "honest", Rewrite())
    sampled, nucleus = trial["decision"]["tests"]["sampled"], trial["decision"]["tests"]["nucleus"]
    assert trial["passed"], trial["reasons"]
    assert not sampled["rejected"] and sampled["p_value"] > 0.01, sampled
    assert abs(sampled["shift"]) < 3 * sampled["standard_error"] + 0.05, sampled  # centred on zero
    assert not nucleus["rejected"] and nucleus["p_value"] > 0.01, nucleus
    power = next(n for n in trial["notes"] if n.startswith("policy power: nucleus"))
    assert "sampled answers" in power and "UNDERPOWERED" in power, power  # the mean test's shortfall: said


def test_more_top_logprobs_than_the_server_allows_stops_scoring_naming_the_fix(vllm_server):
    """vLLM refuses `prompt_logprobs` above its `--max-logprobs` with a 400 on every request
    (sampling_params.py `_validate_logprobs`): score_policy stops with what to change rather than
    leaving every item unscored as if each were refused for itself."""
    from eagle3_data.config import PolicyConfig
    from eagle3_data.engines.vllm import VLLM
    from eagle3_data.errors import UserError
    from eagle3_data.nucleus import Nucleus
    from eagle3_data.stages.policy import Item, ScoreEndpoints, score_items
    from eagle3_devtools.vllm_serve import MAX_LOGPROBS

    item = Item("s0", "overflow", "overflow", (163_584, 1000, 2000, 3000, 4000), 3)
    nucleus = Nucleus(1.0, 0.95)
    got, refused, outside = score_items(
        [item], ScoreEndpoints([vllm_server.url], VLLM), PolicyConfig(top_logprobs=3), nucleus, 163_840
    )
    assert len(got[0]) == 2 and refused == {} and outside[0] in (0, 1, 2), (got, outside)
    with pytest.raises(
        UserError,
        match=rf"Requested prompt logprobs of {MAX_LOGPROBS + 1}, which is greater than max "
        rf"allowed: {MAX_LOGPROBS}.*--max-logprobs at least policy.top_logprobs",
    ):
        score_items(
            [item],
            ScoreEndpoints([vllm_server.url], VLLM),
            PolicyConfig(top_logprobs=MAX_LOGPROBS + 1),
            nucleus,
            163_840,
        )


def test_a_calibration_answer_is_counted_against_the_engines_own_argmax(vllm_server):
    """The greedy test's counts (score_items with K = 1 for a calibration item, `off_argmax`): the
    engine's own greedy continuation (vLLM's /v1/completions at temperature 0, its ids returned:
    the oracle is the engine's generation, not the scoring code) has no token off the argmax; with
    its last token swapped for an id the engine did not pick, that one token is off when the
    argmax lies above it within `greedy_max_gap`, and not counted beyond (a re-split's distance)."""
    import httpx

    from eagle3_data.config import PolicyConfig
    from eagle3_data.engines.vllm import VLLM
    from eagle3_data.nucleus import LOGIT_MARGIN
    from eagle3_data.stages.policy import Item, ScoreEndpoints, score_items
    from eagle3_devtools.vllm_serve import SERVED_MODEL_NAME

    prompt = [163_584, 1000, 2000, 3000, 4000, 5000]
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    greedy = r.json()["choices"][0]["token_ids"]
    assert len(greedy) == 12, r.json()
    margin = LOGIT_MARGIN["float32"]
    policy = PolicyConfig(nucleus_logit_margin=margin)
    item = Item("c0", "overflow", "both", tuple(prompt + greedy), len(prompt))
    (argmax,), refused, (off,) = score_items([item], ScoreEndpoints([vllm_server.url], VLLM), policy)
    assert refused == {} and len(argmax) == 12 and off == 0, (argmax, off)
    other = 1 if greedy[-1] != 1 else 2
    item = Item("c1", "overflow", "both", tuple(prompt + greedy[:-1] + [other]), len(prompt))
    (got,), refused, (off,) = score_items([item], ScoreEndpoints([vllm_server.url], VLLM), policy)
    assert refused == {} and got[:-1] == argmax[:-1], (got, argmax)
    gap = argmax[-1] - got[-1]
    assert gap > margin and off == int(gap <= policy.greedy_max_gap), (gap, off)
    for max_gap, counted in ((gap * 2, 1), (gap / 2, 0)):
        wide = PolicyConfig(nucleus_logit_margin=margin, greedy_max_gap=max_gap)
        assert score_items([item], ScoreEndpoints([vllm_server.url], VLLM), wide)[2] == [counted], max_gap
