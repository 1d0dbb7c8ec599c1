"""vLLM hidden-state extraction against vLLM plain prefill and the transformers backend, one run.

Same samples, same machine, interleaved repeats (best of N each), so the ratios hold even when
the machine's load drifts:
1. vLLM extract: `extract_rows` on the `vllm` backend, end to end (engine prefill with the
   extract_hidden_states method, the connector's per-request files, read + layer mapping + final
   norm, checks, packing, bf16 shards written).
2. vLLM engine only: the engine's own time for the same batches (generate + drain, from the
   worker), i.e. extraction minus our read/pack/write.
   vLLM extract without log-probs: 1. with `HiddenStatesConfig.logprobs` off, so the LM head over
   every token (target_head/logprobs.py; on this tiny target most of 1.'s time: its head is
   84% of a token's FLOPs, 3.5% at Kimi-K2.5's size) is apart from what extraction itself costs.
3. vLLM plain prefill: the same engine settings without the extraction method or connector,
   `max_tokens=1`: what a prefill costs at all (the floor for any extraction on this engine).
4. transformers: `extract_rows` on the `transformers` backend (the reference).
Also bytes per token: packed shards (bf16) vs the minimum 3*H*2, and the connector's transient
per-request files. Computes in fp32 on CPU (bf16 on CUDA).

    .venv/bin/python benchmarks/vllm_extract.py [--samples 64] [--repeats 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "benchmarks"))

from extract_throughput import ensure_model, make_rows  # noqa: E402

from eagle3_data.config import HiddenStatesConfig  # noqa: E402
from eagle3_data.stages.hidden_states.backends import TransformersBackend  # noqa: E402
from eagle3_data.stages.hidden_states.extract import extract_rows, plan_batches  # noqa: E402
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices  # noqa: E402
from eagle3_data.stages.hidden_states.vllm_backend import VllmBackend, vllm_layer_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.repeats = 4, 1

    model_dir = ensure_model(args.model)
    t0 = time.perf_counter()
    vllm = VllmBackend(model_dir, max_model_len=args.max_model_len)
    plain = VllmBackend(model_dir, max_model_len=args.max_model_len, worker_args=["--plain"])
    hf = TransformersBackend(model_dir)
    info = vllm.describe()
    rows = make_rows(args.samples, 0, info.vocab_size)
    tokens = sum(len(r["input_ids"]) for r in rows)
    L = info.num_layers
    indices = hidden_state_indices(default_layer_ids(L, "output"), "output", L)
    layer_ids = vllm_layer_ids(indices, True, L)
    batches = [
        [rows[i]["input_ids"] for i in b] for b in plan_batches([len(r["input_ids"]) for r in rows], args.token_budget)
    ]
    opts = HiddenStatesConfig(last_hidden=True, batch_tokens=args.token_budget, shard_tokens=16_384)
    no_logprobs = opts.model_copy(update={"logprobs": False})
    # warm-up: engines started (counted apart), kernels touched
    vllm.forward([rows[0]["input_ids"]], indices, True)
    plain.request([rows[0]["input_ids"]], layer_ids)
    hf.forward([rows[0]["input_ids"]], indices, True)
    started_s = time.perf_counter() - t0

    runs = {"vllm_extract": [], "vllm_engine": [], "vllm_extract_no_logprobs": [], "vllm_plain": [], "transformers": []}
    summaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            before, bytes_before = vllm.stats["engine_seconds"], vllm.stats["file_bytes"]
            t = time.perf_counter()
            summaries["vllm"] = extract_rows(vllm, rows, Path(tmp) / f"v{k}", "v", opts)
            runs["vllm_extract"].append(time.perf_counter() - t)
            runs["vllm_engine"].append(vllm.stats["engine_seconds"] - before)
            file_bytes = (vllm.stats["file_bytes"] - bytes_before) / tokens
            t = time.perf_counter()
            extract_rows(vllm, rows, Path(tmp) / f"n{k}", "n", no_logprobs)
            runs["vllm_extract_no_logprobs"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for b in batches:
                plain.request(b, layer_ids)
            runs["vllm_plain"].append(time.perf_counter() - t)
            t = time.perf_counter()
            summaries["transformers"] = extract_rows(hf, rows, Path(tmp) / f"t{k}", "t", opts)
            runs["transformers"].append(time.perf_counter() - t)
    vllm.close()
    plain.close()
    best = {k: min(v) for k, v in runs.items()}
    rate = {k: tokens / v for k, v in best.items()}
    h = info.hidden_size
    s = summaries["vllm"]
    print(
        f"model={info.name} L={L} H={h} device={s['device']} compute={s['compute_dtype']} engine={s['engine']} "
        f"samples={len(rows)} tokens={tokens} batches={len(batches)} layers(vLLM ids)={layer_ids} "
        f"repeats={args.repeats} (best of); engines + model load {started_s:.0f} s"
    )
    for k in runs:
        print(f"{k:24s} {rate[k]:9.0f} tok/s")
    print(
        f"RATIO vllm_extract vllm_extract/vllm_plain = {rate['vllm_extract'] / rate['vllm_plain']:.2f}, "
        f"without log-probs {rate['vllm_extract_no_logprobs'] / rate['vllm_plain']:.2f}"
    )
    print(
        f"ratios: vllm_extract/vllm_plain = {rate['vllm_extract'] / rate['vllm_plain']:.2f}, "
        f"vllm_extract_no_logprobs/vllm_plain = {rate['vllm_extract_no_logprobs'] / rate['vllm_plain']:.2f}, "
        f"log-probs' cost = {rate['vllm_extract_no_logprobs'] / rate['vllm_extract'] - 1:+.0%}, "
        f"vllm_engine/vllm_plain = {rate['vllm_engine'] / rate['vllm_plain']:.2f}, "
        f"vllm_extract/transformers = {rate['vllm_extract'] / rate['transformers']:.2f}"
    )
    print(
        f"bytes/token: packed shards (bf16 aux + last) vllm {s['bytes_per_token']:.1f}, transformers "
        f"{summaries['transformers']['bytes_per_token']:.1f} (min aux 3*H*2 = {3 * h * 2}); connector files "
        f"(transient, {len(layer_ids)} ids x H x {4 if s['compute_dtype'] == 'float32' else 2} B) "
        f"{file_bytes:.1f} per token"
    )


if __name__ == "__main__":
    main()
