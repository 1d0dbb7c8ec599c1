"""Both hidden-state backends on one GPU, bf16, on a mid-size random DeepSeek-V3 built locally.

No hub: the model is a random `DeepseekV3ForCausalLM` (MLA with Kimi's kv_lora_rank 512 / rope 64,
Kimi's yarn rope, sigmoid + noaux_tc routing, MoE) written to --cache and reused. The same
samples go through the `transformers` backend and the `vllm` backend (stored with
storage_dtype=compute, i.e. bf16 as computed); printed: tokens/s of each (model load and engine
start excluded, reported apart), and the relative error between them per layer (max |a - b| /
max |b| per sample, then the max and median over samples) for the aux layers and last_hidden.
bf16 on both sides: expect ~1e-2, not the 1e-7 of the fp32 CPU tests (different kernels,
bf16 accumulation orders). Run through benchmarks/gpu_extract.sh.

    python benchmarks/gpu_extract.py [--layers 16 --hidden 2048 --experts 16] [--samples 192]
    python benchmarks/gpu_extract.py --smoke     # tiny sizes, any device: checks the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from extract_throughput import lm_head_share, sync  # noqa: E402

from eagle3_data.exports.shards import ShardReader  # noqa: E402
from eagle3_data.extraction_params import ExtractOptions  # noqa: E402
from eagle3_data.stages.hidden_states.backends import TransformersBackend  # noqa: E402
from eagle3_data.stages.hidden_states.extract import extract_rows  # noqa: E402
from eagle3_data.stages.hidden_states.vllm_backend import VllmBackend  # noqa: E402


def build_model(out: Path, *, layers: int, hidden: int, experts: int, seed: int = 0) -> Path:
    """A random DeepSeek-V3 of the given size with the shapes and config keys vLLM's MLA and MoE take."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle3_data.builds.tiny_model import ENGINE_CONFIG_KEYS, KIMI_ROPE

    if (out / "config.json").exists():
        return out
    heads = max(1, hidden // 128)
    config = DeepseekV3Config(
        vocab_size=163_840,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=max(64, hidden // 3 // 64 * 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=min(8, experts // 2),
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=min(1536, 3 * hidden // 4),
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=262_144,
        rope_parameters=dict(KIMI_ROPE),
        routed_scaling_factor=2.827,
        tie_word_embeddings=False,
        bos_token_id=163_584,
        eos_token_id=163_585,
        pad_token_id=163_839,
    )
    config.dtype = "bfloat16"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            for module in model.modules():
                bias = getattr(module, "e_score_correction_bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.copy_(torch.randn_like(bias) * 0.01)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.update(ENGINE_CONFIG_KEYS)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.rename(out)
    del model
    return out


def make_rows(n: int, seed: int, median: int, cap: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = int(min(cap, max(16, rng.lognormvariate(0, 0.6) * median)))
        rows.append(
            {
                "sample_id": f"g{i}",
                "input_ids": [rng.randrange(163_584) for _ in range(length)],
                "loss_mask": [0] * (length // 3) + [1] * (length - length // 3),
            }
        )
    return rows


def rel_errors(a_dir: Path, b_dir: Path, n_layers: int) -> dict[str, list[float]]:
    a = {s.sample_id: s for p in sorted(a_dir.glob("*.safetensors")) for s in ShardReader(p)}
    b = {s.sample_id: s for p in sorted(b_dir.glob("*.safetensors")) for s in ShardReader(p)}
    errs: dict[str, list[float]] = {f"aux{j}": [] for j in range(n_layers)} | {"last": []}
    for sid, sa in a.items():
        sb = b[sid]
        ya, yb = sa.aux_hidden_states.float(), sb.aux_hidden_states.float()
        H = ya.shape[1] // n_layers
        for j in range(n_layers):
            x, y = ya[:, j * H : (j + 1) * H], yb[:, j * H : (j + 1) * H]
            errs[f"aux{j}"].append(float((x - y).abs().max() / y.abs().max()))
        errs["last"].append(
            float(
                (sa.last_hidden_states.float() - sb.last_hidden_states.float()).abs().max()
                / sb.last_hidden_states.float().abs().max()
            )
        )
    return errs


def logprob_errors(model_dir: Path, shard_dirs: dict[str, Path], rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per name, the stored `target_logprobs` of the extraction in `shard_dirs[name]` against
    transformers' own forward of the same ids (one independent load and one forward per row for
    all of them; log_softmax of its logits in fp32): max and mean |difference| over positions 1..,
    and the worst per-sample mean over trained tokens (the statistic verify.py gates on): the
    numeric noise of the extraction's log-probabilities at this dtype."""
    from transformers import AutoModelForCausalLM

    stored = {
        name: {s.sample_id: s for p in sorted(d.glob("*.safetensors")) for s in ShardReader(p)}
        for name, d in shard_dirs.items()
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    figures = {name: {"worst": 0.0, "total": 0.0, "n": 0, "sample_worst": 0.0} for name in shard_dirs}
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor([r["input_ids"]], device=device)
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0].cpu()
            trained = torch.tensor(r["loss_mask"][1:], dtype=torch.bool)
            for name, f in figures.items():
                diff = (stored[name][r["sample_id"]].target_logprobs[1:] - lp).abs()
                f["worst"] = max(f["worst"], float(diff.max()))
                f["total"] += float(diff.sum())
                f["n"] += diff.numel()
                f["sample_worst"] = max(f["sample_worst"], float(diff[trained].mean()))
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        name: {
            "samples": len(rows),
            "tokens": f["n"],
            "max_abs": f["worst"],
            "mean_abs": f["total"] / max(f["n"], 1),
            "worst_sample_mean_abs": f["sample_worst"],
        }
        for name, f in figures.items()
    }


@contextmanager
def fp32_head():
    """Extraction's log-probability head with its product in fp32 on every device (the previous one)."""
    from eagle3_data.stages.hidden_states import extract
    from eagle3_data.target_head import logprobs

    class Fp32Head(logprobs.LogprobHead):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.head = self.head.float()

    saved, extract.LogprobHead = extract.LogprobHead, Fp32Head
    try:
        yield
    finally:
        extract.LogprobHead = saved


def active_parameters(model_dir: Path) -> int:
    """Parameters that run per token: all but the embedding and the LM head, the routed experts'
    counted at num_experts_per_tok of n_routed_experts (for `lm_head_share`)."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    total = routed = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                size = math.prod(st.get_slice(k).get_shape())
                total += size
                routed += size if ".mlp.experts." in k else 0
    head = cfg["hidden_size"] * cfg["vocab_size"]
    return total - 2 * head - routed + routed * cfg["num_experts_per_tok"] // cfg["n_routed_experts"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "gpu-bench")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--median-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--token-budget", type=int, default=32_768)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["transformers", "vllm"],
        choices=["transformers", "vllm"],
        help="transformers alone where no CUDA vLLM can be installed (a lent machine without a registry)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="transformers passes of each kind, interleaved")
    ap.add_argument("--oracle-samples", type=int, default=8, help="samples whose log-probabilities are checked")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script anywhere in a minute")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.experts, args.samples, args.median_tokens, args.max_tokens = (
            8,
            256,
            4,
            6,
            64,
            256,
        )
        args.repeats, args.oracle_samples = 1, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model_dir = build_model(
        args.cache / f"dsv3-L{args.layers}-H{args.hidden}-E{args.experts}",
        layers=args.layers,
        hidden=args.hidden,
        experts=args.experts,
    )
    build_s = time.perf_counter() - t0
    rows = make_rows(args.samples, 0, args.median_tokens, args.max_tokens)
    tokens = sum(len(r["input_ids"]) for r in rows)
    opts = ExtractOptions(
        last_hidden=True, storage_dtype="compute", token_budget=args.token_budget, out_shard_tokens=1 << 20
    )
    no_logprobs = replace(opts, logprobs=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t = time.perf_counter()
        hf = TransformersBackend(model_dir, dtype=dtype)
        hf.forward([rows[0]["input_ids"]], [2], False)  # warm-up
        hf_load_s = time.perf_counter() - t
        timings: dict[str, list[float]] = {"none": [], "shipped": [], "fp32": []}
        for k in range(args.repeats):  # interleaved, best of: the first pass also warms kernels up
            for variant, where, options in (
                ("none", "hf-no-logprobs", no_logprobs),
                ("shipped", "hf", opts),
                ("fp32", "hf-fp32-head", opts),
            ):
                with fp32_head() if variant == "fp32" else contextlib.nullcontext():
                    t = time.perf_counter()
                    summary = extract_rows(hf, rows, out / f"{where}-{k}", where, options)
                    sync(device)
                    timings[variant].append(time.perf_counter() - t)
                if variant == "shipped":
                    s_hf = summary
        hf_nolp_s, hf_s, hf_fp32_s = (min(timings[v]) for v in ("none", "shipped", "fp32"))
        del hf
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()  # the engine takes its share of what is free now
        errors = logprob_errors(
            model_dir, {"shipped": out / "hf-0", "fp32": out / "hf-fp32-head-0"}, rows[: args.oracle_samples]
        )
        cfg = json.loads((model_dir / "config.json").read_text())
        report = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "dtype": str(dtype),
            "model": model_dir.name,
            "samples": len(rows),
            "tokens": tokens,
            "build_s": round(build_s, 1),
            "transformers_load_s": round(hf_load_s, 1),
            "tokens_per_s": {"transformers": round(tokens / hf_s)},
            "tokens_per_s_transformers_without_logprobs": round(tokens / hf_nolp_s),
            "transformers_logprobs_cost": round(hf_s / hf_nolp_s - 1, 3),
            "transformers_fp32_head_logprobs_cost": round(hf_fp32_s / hf_nolp_s - 1, 3),
            "lm_head_flop_share": round(
                lm_head_share(cfg["vocab_size"], cfg["hidden_size"], active=active_parameters(model_dir)), 4
            ),
            "logprobs_vs_transformers_forward": errors["shipped"],
            "fp32_head_logprobs_vs_transformers_forward": errors["fp32"],
        }
        if "vllm" not in args.backends:
            print(json.dumps(report, indent=1))
            print(
                f"RATIO gpu_extract transformers log-probs cost = {report['transformers_logprobs_cost']:+.1%} "
                f"(fp32 head {report['transformers_fp32_head_logprobs_cost']:+.1%})"
            )
            return
        t = time.perf_counter()
        vllm = VllmBackend(
            model_dir,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=args.max_tokens + 8,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=0.85,
        )
        vllm.forward([rows[0]["input_ids"]], [2, args.layers // 2, args.layers - 3], True)  # engine start + warm-up
        vllm_load_s = time.perf_counter() - t
        warm_engine_s = vllm.stats["engine_seconds"]  # the warm-up batch's: not part of the timed pass
        t = time.perf_counter()
        s_v = extract_rows(vllm, rows, out / "vllm", "v", opts)
        vllm_s = time.perf_counter() - t
        engine_s = vllm.stats["engine_seconds"] - warm_engine_s
        vllm.close()
        errs = rel_errors(out / "vllm", out / "hf-0", len(s_v["layer_ids"]))
    report["tokens_per_s"] |= {"vllm": round(tokens / vllm_s), "vllm_engine_only": round(tokens / max(engine_s, 1e-9))}
    report |= {
        "layer_ids": s_v["layer_ids"],
        "engine": s_v["engine"],
        "vllm_start_s": round(vllm_load_s, 1),
        "vllm_over_transformers": round(hf_s / vllm_s, 2),
        "rel_error_max": {k: max(v) for k, v in errs.items()},
        "rel_error_median": {k: sorted(v)[len(v) // 2] for k, v in errs.items()},
        "bytes_per_token": {
            "transformers": round(s_hf["bytes_per_token"], 1),
            "vllm": round(s_v["bytes_per_token"], 1),
        },
    }
    print(json.dumps(report, indent=1))
    print(f"RATIO gpu_extract vllm/transformers = {report['vllm_over_transformers']:.2f}")


if __name__ == "__main__":
    main()
