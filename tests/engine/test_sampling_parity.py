"""One config samples the same on SGLang and vLLM: the requests our two wire adapters build are
read by each engine's own code (SGLang's SamplingParams in the parser oracle, vLLM's
CompletionRequest.to_sampling_params in its venv), with vLLM given the defaults it takes from a
model's generation_config.json, and the effective sampling is compared key by key. Left unset, a
key is filled by vLLM from the model (top_k 20 here) and by SGLang /generate from its own
neutral default: the second test shows that old request shape differ."""

from __future__ import annotations

import json
import subprocess

import pytest

from eagle3_data.engines.sglang import SGLANG
from eagle3_data.engines.vllm import VLLM

VOCAB = 163_840
# What vLLM's get_diff_sampling_param() takes from a model's generation_config.json (the values
# of a model that ships its own sampling defaults).
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
CONFIG = {
    "temperature": 1.0,
    "top_p": 0.95,
    "max_new_tokens": 64,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

VLLM_SCRIPT = r"""
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
case = json.loads(sys.stdin.read())
out = []
for body in case["bodies"]:
    body = dict(body, model="m")
    sp = CompletionRequest(**body).to_sampling_params(max_tokens=body["max_tokens"],
                                                      default_sampling_params=case["defaults"])
    out.append({"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k or None,
                "min_p": sp.min_p, "repetition_penalty": sp.repetition_penalty,
                "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
                "max_new_tokens": sp.max_tokens})
print(json.dumps(out))
"""
DROPPED = ("top_k", "min_p", "repetition_penalty")


def _vllm_effective(vllm_python: str, bodies: list[dict]) -> list[dict]:
    done = subprocess.run(
        [vllm_python, "-c", VLLM_SCRIPT],
        input=json.dumps({"bodies": bodies, "defaults": MODEL_DEFAULTS}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_reads(vllm_python) -> dict:
    """vLLM's effective sampling for the full config and for it without each DROPPED key (one
    interpreter start for all)."""
    configs = {"all": CONFIG, **{k: {n: v for n, v in CONFIG.items() if n != k} for k in DROPPED}}
    return dict(zip(configs, _vllm_effective(vllm_python, [_requests(c)[1] for c in configs.values()])))


def _requests(sampling: dict) -> tuple[dict, dict]:
    ids = [1, 2, 3]
    _, sglang = SGLANG.request(ids, SGLANG.sampling(sampling), "rid", {})
    _, vllm = VLLM.request(ids, VLLM.sampling(sampling), "rid", {})
    return sglang["sampling_params"], vllm


def test_one_config_samples_the_same_on_both_engines(vllm_reads, sglang_oracle):
    sglang = sglang_oracle.effective_sampling(_requests(CONFIG)[0], VOCAB)
    assert sglang == vllm_reads["all"] == {**CONFIG, "top_k": None}, (sglang, vllm_reads["all"])


@pytest.mark.parametrize("dropped", DROPPED)
def test_a_key_left_unset_samples_differently(vllm_reads, sglang_oracle, dropped):
    """The requests before every key was sent: vLLM fills the key from the model, SGLang does not."""
    sglang = sglang_oracle.effective_sampling(_requests({k: v for k, v in CONFIG.items() if k != dropped})[0], VOCAB)
    vllm = vllm_reads[dropped]
    assert sglang[dropped] != vllm[dropped] and vllm[dropped] == MODEL_DEFAULTS[dropped]
