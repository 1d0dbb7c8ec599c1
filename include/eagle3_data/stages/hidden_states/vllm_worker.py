"""The vLLM engine process behind `VllmBackend`: run with the vLLM venv's python.

    .venv-vllm/bin/python -m eagle3_data.stages.hidden_states.vllm_worker --model DIR --layer-ids 2,4,5,8 \
        --storage DIR [--tensor-parallel-size 8] [--dtype bfloat16] [--max-model-len 8192]

vLLM pins its own torch and `transformers<5.20` (we pin 5.24), so it lives in its own venv and
this module imports nothing but the standard library, torch and vLLM (the `eagle3_data` package
is on PYTHONPATH, never installed there with its dependencies). One engine lives for the whole
process: the backend sends batch after batch over stdin, across shards.

Protocol, one JSON object per line: stdin takes `{"op": "extract", "batch": [[ids], ...]}` (with
`--images N`, also `"images": [[path, ...], ...]`: each sample's image files, in prompt order) or
`{"op": "stop"}`; the protocol stream (the original stdout; vLLM's own prints go to stderr)
answers first `{"ready": ..., engine facts}`, then per batch `{"files": [path, ...]}` in batch
order (each a safetensors file of the connector: `hidden_states` [T, n_ids, H] for the sorted
ids, `token_ids` [T]) with `engine_seconds` (generate + drain), or `{"error": "..."}`. The files are complete
when named: the reader owns
and deletes them.

Engine settings that matter for correctness: the `extract_hidden_states` speculative method
with the connector (the stock `ExampleHiddenStatesConnector` on CUDA, `CpuHiddenStatesConnector`
on CPU), `max_tokens=1` (prefill only), prefix caching OFF (a cached prefix is not recomputed,
so its states would be missing: vllm#44485), no tokenizer (ids in, states out), language model
only unless `--images N` (Kimi-K2.5's multimodal processor needs the tokenizer).

Images (`--images N`, up to N per sample): each sample's ids already hold every image's
image-placeholder run expanded (what the model sees); vLLM gets the images as `vision_chunk` items
(Kimi-K2.5's modality) beside them, runs MoonViT on its own processor's pixels, and leaves a run
that already has its processor's length as it is (so the connector's `token_ids` are our ids
exactly when our count agrees with vLLM's processor: the backend compares them). On CPU such an
engine runs multi-process with `spawn`: in one process, vLLM 0.32's Triton-kernel override scan
(vllm/triton_utils/dispatcher.py:139, `vars(value).get("kernel")` over every loaded module) calls
`vars()` on llvmlite's `ffi.lib`, whose `__getattr__` answers any name (`AttributeError:
'_lib_fn_wrapper' object has no attribute 'get'`); numba (hence llvmlite) is loaded by the
Kimi image processor before the worker starts.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from typing import Any


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm_worker")
    p.add_argument("--model", required=True)
    p.add_argument(
        "--layer-ids", required=True, help="vLLM aux ids, ascending: id i = input of layer i, L = last output"
    )
    p.add_argument("--storage", required=True, help="directory for the connector's per-request files")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--images", type=int, default=0, help="up to this many images per sample (0: text only)")
    p.add_argument(
        "--plain",
        action="store_true",
        help="no extraction (no speculative method, no connector): the plain-prefill baseline of the benchmark",
    )
    return p.parse_args(argv)


def _protocol_stream():
    """Keep the real stdout for answers; everything vLLM prints goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _wait_written(path: str) -> None:
    """Block until the connector released the file's lock (the write finished), then drop the lock file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
        os.remove(lock)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = _protocol_stream()
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    if layer_ids != sorted(set(layer_ids)):
        raise SystemExit(
            f"--layer-ids {args.layer_ids}: must be ascending and unique (vLLM stores them in layer order)"
        )

    from vllm.platforms import current_platform

    on_cpu = current_platform.device_type == "cpu"
    if on_cpu and args.images:  # see the module docstring: one process cannot hold numba and the engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if on_cpu:
        # One process: ~3 s to start instead of ~30 s; the engine is then stepped here (below).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    dtype = args.dtype if args.dtype != "auto" else ("float32" if on_cpu else "bfloat16")

    import vllm
    from vllm import LLM, SamplingParams

    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": args.storage},
    }
    if on_cpu:
        connector.update(
            kv_connector="CpuHiddenStatesConnector",
            kv_connector_module_path="eagle3_data.stages.hidden_states.vllm_connector",
        )
    kwargs = {}
    if on_cpu:
        kwargs["attention_backend"] = "CPU_MLA"
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if not args.plain:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        }
        kwargs["kv_transfer_config"] = connector
    if args.images:
        kwargs["limit_mm_per_prompt"] = {"vision_chunk": args.images}
    llm = LLM(
        model=args.model,
        dtype=dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        skip_tokenizer_init=not args.images,
        # Kimi-K2.5 is a vision-language checkpoint (KimiK25ForConditionalGeneration): without this
        # vLLM builds its multimodal processor, which refuses to start without a tokenizer; ids in,
        # text-only states out need neither the processor nor the vision encoder's budget.
        language_model_only=not args.images,
        enforce_eager=on_cpu,
        **kwargs,
    )
    hf = llm.llm_engine.model_config.hf_text_config
    from importlib.metadata import version

    out.write(
        json.dumps(
            {
                "ready": True,
                "engine": f"vllm {vllm.__version__}",
                "distribution": f"vllm-cpu {version('vllm-cpu')}" if on_cpu else None,
                "device": current_platform.device_type,
                "dtype": dtype,
                "num_layers": hf.num_hidden_layers,
                "hidden_size": hf.hidden_size,
                "vocab_size": hf.vocab_size,
                "layer_ids": layer_ids,
                "tensor_parallel_size": args.tensor_parallel_size,
                "max_model_len": args.max_model_len,
            }
        )
        + "\n"
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "stop":
            break
        try:
            started = time.perf_counter()
            outputs = llm.generate(_prompts(msg), params, use_tqdm=False)
            if in_process:
                # generate() returns once every request produced its token; the connector writes a
                # request's file in a later step (when its blocks are released): step until idle.
                core = llm.llm_engine.engine_core.engine_core
                while core.scheduler.has_requests():
                    llm.llm_engine.step()
            engine_seconds = time.perf_counter() - started
            files = []
            for o in outputs if not args.plain else ():
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError(f"request {o.request_id}: no hidden_states_path in kv_transfer_params")
                _wait_written(path)
                files.append(path)
            out.write(json.dumps({"files": files, "engine_seconds": engine_seconds}) + "\n")
        except Exception as exc:  # reported to the backend, which raises it with the log tail
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
    return 0


def _prompts(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch as vLLM prompts: ids, and each sample's images as Kimi-K2.5 `vision_chunk` items."""
    images = msg.get("images") or [[] for _ in msg["batch"]]
    prompts = []
    for ids, paths in zip(msg["batch"], images, strict=True):
        prompt = {"prompt_token_ids": ids}
        if paths:
            from PIL import Image

            prompt["multi_modal_data"] = {
                "vision_chunk": [{"type": "image", "image": Image.open(p).convert("RGB")} for p in paths]
            }
        prompts.append(prompt)
    return prompts


if __name__ == "__main__":
    sys.exit(main())
