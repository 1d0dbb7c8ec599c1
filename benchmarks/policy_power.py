"""The policy check against honest and faulty providers, on vLLM CPU: what the gate sees, at what power.

The local engine is a `vllm serve` of the tiny target; the "provider" is the same engine behind
eagle3_devtools.provider_proxy (OpenRouter's chat route forwarded byte for byte), which
- honest: changes nothing (run `--runs` times, each with another sampling seed: the spread of
  the gap between honest runs);
- temp1.3: samples at 1.3 times the asked temperature (1.3 for 1.0);
- top_p: drops `top_p` (0.95 asked: samples from the full distribution);
- int8: forwards to a second `vllm serve` of the tiny target's int8-rounded copy
  (eagle3_devtools.int8_model: per-channel symmetric int8 on every linear weight).
Each trial is the pipeline's stages (eagle3_devtools.policy_trial): prompts routed half to the
provider with `--calibration` prompts greedy on both paths, generate_local, generate_overflow,
reconstruct, score_policy, validate, at the default policy settings (pilot 32 a side, the
sample sized from its spread, at most policy.max_samples). Per trial: samples scored a side,
the sampled test's gap (local minus overflow mean log-probability per token, per sample) with
its standard error, p-value and minimum detectable shift at 90% power, the pairs' mean
difference and p, the greedy test's counts (calibration answer tokens that are not the
target's argmax, local and overflow) and p, the nucleus test's counts (answer tokens provably outside the sampling's
nucleus, local and overflow, both on one tokenisation path, from the local engine's top
`--top-logprobs` log-probabilities at every position, as in production: nucleus), its
p-value and smallest detectable outside-rate at 90% power, and the gate's verdict on policy.

    .venv/bin/python benchmarks/policy_power.py [--samples 192] [--runs 3] [--max-new-tokens 48]
        [--providers honest temp1.3 top_p int8] [--smoke] [--top-logprobs 1000]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import seaweedfs, store_for  # noqa: E402

from eagle3_devtools.provider_proxy import Rewrite, start_provider_proxy  # noqa: E402
from eagle3_devtools.vllm_serve import MAX_LOGPROBS  # noqa: E402

FAULTS = {
    "honest": Rewrite(),
    "temp1.3": Rewrite(temperature_factor=1.3),
    "top_p": Rewrite(ignore=("top_p",)),
    "int8": Rewrite(),
}


def _model():
    """The tiny target (cached) and its tokenizer."""
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.builds.sources import TINY_MODEL_ARGS
    from eagle3_data.builds.tiny_model import cached_tiny_model

    tokenizer = cached_kimi_tokenizer(REPO / ".cache")
    return tokenizer, cached_tiny_model(tokenizer, REPO / ".cache", **TINY_MODEL_ARGS)


def _serve(model, logs: Path, name: str):
    """A `vllm serve` of `model`, healthy. The int8 one starts only when its trial comes (each
    server holds ~4 GB: on a small machine two at once only when needed)."""
    from eagle3_data.stages.hidden_states.vllm_backend import vllm_python
    from eagle3_devtools.vllm_serve import start_vllm_server

    server = start_vllm_server(vllm_python(), model, logs / f"{name}.log")
    server.wait_healthy(900)
    return server


def _row(name: str, run: int, t: dict) -> str:
    tests, figures = t["decision"]["tests"], t["figures"]
    s, p = tests.get("sampled"), tests.get("pairs")
    sampled = (
        (
            f"{s['samples'][0]}+{s['samples'][1]} | {s['shift']:+.3f} +- {s['standard_error']:.3f} | "
            f"{s['min_detectable_shift']:.3f} | {s['p_value']:.2g}"
        )
        if s
        else "- | - | - | -"
    )
    pairs = f"{p['samples'][0]} | {p['shift']:+.3f} | {p['p_value']:.2g}" if p else "- | - | -"
    nu = tests.get("nucleus")
    if nu:
        (n, m), (a, b), mdr = nu["tokens"], nu["outside"], nu["min_detectable_rate"]
        nucleus = f"{a}/{n} | {b}/{m} | {nu['p_value']:.2g} | {'-' if mdr is None else f'{mdr:.2%}'}"
    else:
        nucleus = "- | - | - | -"
    gr = tests.get("greedy")
    greedy = (
        f"{gr['outside'][0]}/{gr['tokens'][0]} | {gr['outside'][1]}/{gr['tokens'][1]} | {gr['p_value']:.2g}"
        if gr
        else "- | - | -"
    )
    policy = [r for r in t["reasons"] if "policy" in r]
    verdict = "FAILS on policy" if policy else ("passes" if t["passed"] else "fails (not policy)")
    return (
        f"| {name} | {run} | {sampled} | {pairs} | {nucleus} | {greedy} | {figures['sizing']['required']} | "
        f"{verdict} | {t['seconds']:.0f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=192, help="prompts per trial, half to the provider")
    ap.add_argument("--calibration", type=int, default=16, help="of them, greedy on both paths (pairs)")
    ap.add_argument("--runs", type=int, default=3, help="honest trials, each with another sampling seed")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--providers", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--smoke", action="store_true", help="honest and temp1.3 once at 64 prompts")
    ap.add_argument(
        "--top-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help="log-probabilities per position the scoring requests ask for (policy.top_logprobs; the launcher "
        f"allows {MAX_LOGPROBS})",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still stops its servers
    if args.smoke:
        args.samples, args.calibration, args.runs, args.providers = 64, 4, 1, ["honest", "temp1.3"]
    from eagle3_devtools.int8_model import cached_int8_model
    from eagle3_devtools.policy_trial import run_trial, trial_run

    tokenizer, model = _model()
    logs = Path(tempfile.mkdtemp(prefix="bench-policy-"))
    servers = {"target": _serve(model, logs, "target")}
    target = servers["target"].url
    print(
        f"policy_power: {args.samples} prompts a trial ({args.calibration} calibration), "
        f"max_new_tokens {args.max_new_tokens}, default policy settings but top_logprobs {args.top_logprobs} "
        "and the fp32 nucleus margin (eagle3_devtools.policy_trial)"
    )
    print(
        "| provider | run | sampled n | gap +- SE (nats/token) | min detectable shift (90%) | p | "
        "pairs n | pairs diff | pairs p | nucleus outside local | overflow | nucleus p | "
        "min detectable outside-rate (90%) | greedy off-argmax local | overflow | greedy p | required n | gate | s |"
    )
    print("|---" * 19 + "|")
    verdicts: dict[str, list[bool]] = {}
    try:
        with seaweedfs() as (handle, _env):
            store = store_for(handle, "policy-power")
            for name in args.providers:
                if name == "int8":
                    servers["int8"] = _serve(cached_int8_model(model, REPO / ".cache"), logs, "int8")
                for run in range(args.runs if name == "honest" else 1):
                    proxy = start_provider_proxy(servers["int8" if name == "int8" else "target"].url, FAULTS[name])
                    try:
                        t0 = time.monotonic()
                        config = trial_run(
                            tokenizer,
                            f"{name}-{run}",
                            max_new_tokens=args.max_new_tokens,
                            sampling_seed=100 + run,
                            top_logprobs=args.top_logprobs,
                        )
                        t = run_trial(
                            store, config, target, proxy.url, samples=args.samples, calibration=args.calibration
                        )
                        t["seconds"] = time.monotonic() - t0
                    finally:
                        proxy.stop()
                    verdicts.setdefault(name, []).append(not any("policy" in r for r in t["reasons"]))
                    print(_row(name, run, t), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    ok = all(verdicts.get("honest", [True])) and not any(v for k, vs in verdicts.items() if k != "honest" for v in vs)
    print(
        f"RATIO policy_power: honest passes {sum(verdicts.get('honest', []))}/{len(verdicts.get('honest', []))}, "
        "faults failing "
        + ", ".join(f"{k} {len(vs) - sum(vs)}/{len(vs)}" for k, vs in verdicts.items() if k != "honest")
        + ("" if ok else " (NOT as expected)")
    )


if __name__ == "__main__":
    main()
