"""Extraction throughput against two baselines measured in the same run, on the same samples.

1. bare forward: the backend's padded forward over the extractor's own batches, nothing written.
   `extract / bare` is the overhead of checks + packing + writing (goal >= 0.9: the writer
   thread overlaps serialisation with compute).
2. naive: the anchors' way, one sample per forward of the full causal LM with
   `output_hidden_states=True` and one `torch.save` file per sample (SpecForge layout).
3. extract without log-probabilities (`HiddenStatesConfig.logprobs=False`): what the per-token
   log-probability of every row (the final norm and one LM-head product per token, logprobs.py)
   costs the extraction, and that head's FLOP share at Kimi-K2.5's size (2*V*H per token against
   2 x 32 B active parameters).
Also bytes per token of the packed shards (bf16 storage, the default whatever the compute dtype;
fp32 storage; fp8) against the minimum 3*H*2, and fp8's measured relative error. Computes on CUDA
when present (bf16), else CPU (fp32).

    .venv/bin/python benchmarks/extract_throughput.py [--samples 48] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

from eagle3_data import fp8  # noqa: E402
from eagle3_data.config import HiddenStatesConfig  # noqa: E402
from eagle3_data.exports.shards import ShardReader  # noqa: E402
from eagle3_data.stages.hidden_states.backends import TransformersBackend  # noqa: E402
from eagle3_data.stages.hidden_states.extract import extract_rows, plan_batches  # noqa: E402
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ensure_model(path: Path | None) -> Path:
    if path is not None:
        return path
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.builds.tiny_model import cached_tiny_model

    return cached_tiny_model(cached_kimi_tokenizer(REPO / ".cache"), REPO / ".cache")


KIMI_VOCAB, KIMI_HIDDEN, KIMI_ACTIVE = 163_840, 7_168, 32e9  # Kimi-K2.5: 32 B parameters active per token


def lm_head_share(vocab: int, hidden: int, model: torch.nn.Module | None = None, active: float | None = None) -> float:
    """The log-probability head's share of a token's forward + head FLOPs: 2*V*H against 2 FLOPs
    per active parameter (`active`, else every parameter of `model` but its embedding and LM
    head: the tiny target is dense enough that all of them run; its MoE routes a few experts, so
    this is an upper bound of the forward and a lower bound of the share)."""
    if active is None:
        skip = {
            id(p)
            for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None
            for p in m.parameters()
        }
        active = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    head = 2 * vocab * hidden
    return head / (2 * active + head)


def make_rows(n: int, seed: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = int(min(512, max(16, rng.lognormvariate(4.8, 0.6))))  # median ~120 tokens
        prompt = length // 3
        rows.append(
            {
                "sample_id": f"b{i}",
                "input_ids": [rng.randrange(vocab) for _ in range(length)],
                "loss_mask": [0] * prompt + [1] * (length - prompt),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each timed run")
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.repeats = 4, 1

    model_dir = ensure_model(args.model)
    backend = TransformersBackend(model_dir)
    info = backend.describe()
    rows = make_rows(args.samples, 0, info.vocab_size)
    tokens = sum(len(r["input_ids"]) for r in rows)
    layer_ids = default_layer_ids(info.num_layers, "output")
    indices = hidden_state_indices(layer_ids, "output", info.num_layers)
    batches = plan_batches([len(r["input_ids"]) for r in rows], args.token_budget)
    backend.forward([rows[0]["input_ids"]], indices, False)  # warm-up (lazy init, kernels)

    def bare() -> float:
        t0 = time.perf_counter()
        for b in batches:
            backend.forward_padded([rows[i]["input_ids"] for i in b], indices, False)
        sync(info.device)
        return time.perf_counter() - t0

    def extract(
        tmp: Path, use_fp8: bool = False, storage_dtype: str = "bf16", logprobs: bool = True
    ) -> tuple[float, dict]:
        # aux states only: the bytes per token compared with their 3H x 2 minimum (RESULTS.md)
        opts = HiddenStatesConfig(
            last_hidden=False,
            batch_tokens=args.token_budget,
            shard_tokens=16_384,
            fp8=use_fp8,
            storage_dtype=storage_dtype,
            logprobs=logprobs,
        )
        t0 = time.perf_counter()
        summary = extract_rows(backend, rows, tmp, "bench", opts)
        return time.perf_counter() - t0, summary

    def naive(tmp: Path) -> float:
        model = backend.model
        t0 = time.perf_counter()
        with torch.inference_mode():
            for r in rows:
                ids = torch.tensor([r["input_ids"]], device=backend.device)
                out = model(input_ids=ids, output_hidden_states=True)
                hs = out.hidden_states
                torch.save(
                    {
                        "input_ids": torch.tensor(r["input_ids"]),
                        "loss_mask": torch.tensor(r["loss_mask"]),
                        "hidden_state": hs[-1].to(torch.bfloat16).cpu(),
                        "aux_hidden_state": torch.cat([hs[i] for i in indices], -1).to(torch.bfloat16).cpu(),
                    },
                    tmp / f"data_{r['sample_id']}.ckpt",
                )
        sync(info.device)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        bares, runs, plain_runs = [], [], []
        for k in range(args.repeats):  # interleaved, so load drift on a shared machine hits all alike
            bares.append(bare())
            runs.append(extract(tmp / f"x{k}"))
            plain_runs.append(extract(tmp / f"n{k}", logprobs=False)[0])
        t_bare = min(bares)
        t_extract, summary = min(runs, key=lambda r: r[0])
        t_plain = min(plain_runs)
        (tmp / "naive").mkdir()
        t_naive = min(naive(tmp / "naive") for _ in range(args.repeats))
        _, summary8 = extract(tmp / "fp8", use_fp8=True)
        _, summary32 = extract(tmp / "fp32", storage_dtype="fp32")
        reader = ShardReader(next((tmp / "x0").glob("*.safetensors")))
        sample = reader.sample(0).aux_hidden_states
        rel = fp8.relative_error(sample, len(layer_ids))
        naive_bytes = sum(p.stat().st_size for p in (tmp / "naive").glob("*.ckpt"))

    h = info.hidden_size
    print(
        f"device={info.device} compute dtype={info.dtype} model={info.name} L={info.num_layers} H={h} "
        f"samples={len(rows)} tokens={tokens} batches={len(batches)} token_budget={args.token_budget}"
    )
    print(f"bare forward      {tokens / t_bare:10.0f} tok/s")
    print(f"extract (packed)  {tokens / t_extract:10.0f} tok/s   extract/bare = {t_bare / t_extract:.2f}")
    print(f"naive per-sample  {tokens / t_naive:10.0f} tok/s   extract/naive = {t_naive / t_extract:.2f}")
    print(
        f"extract without log-probs {tokens / t_plain:10.0f} tok/s   log-probs cost {t_extract / t_plain - 1:+.1%} "
        f"of the extraction; LM-head FLOP share here {lm_head_share(info.vocab_size, h, backend.model):.1%}, "
        f"at Kimi-K2.5's size {lm_head_share(KIMI_VOCAB, KIMI_HIDDEN, active=KIMI_ACTIVE):.1%}"
    )
    print(
        f"RATIO extract_throughput extract/bare = {t_bare / t_extract:.2f}; extract with/without log-probs = "
        f"{t_extract / t_plain:.2f}"
    )
    print(
        f"bytes/token: packed aux stored {summary['dtype']} (computed {summary['compute_dtype']}) "
        f"{summary['bytes_per_token']:.1f} (min 3*H*2 = {3 * h * 2}, "
        f"ratio {summary['bytes_per_token'] / (3 * h * 2):.3f}); stored {summary32['dtype']} "
        f"{summary32['bytes_per_token']:.1f} (ratio {summary32['bytes_per_token'] / (3 * h * 2):.3f}); fp8 aux "
        f"{summary8['bytes_per_token']:.1f} "
        f"({summary8['bytes_per_token'] / summary['bytes_per_token']:.2f}x of bf16, rel. error {rel:.4f}); "
        f"naive files (aux + last) {naive_bytes / tokens:.1f} in {len(rows)} files"
    )


if __name__ == "__main__":
    main()
