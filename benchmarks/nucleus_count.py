"""The extraction's per-token log-probabilities with and without the nucleus count, as shipped
against the previous implementation of the same formulas, in the same run
(hidden_states/logprobs.py `LogprobHead`).

For every position the extraction takes the LM head's [chunk, V] logits (V = 163,840) and their
log-softmax; for a sampled answer it also counts the tokens outside the sampling's nucleus: the
mass of softmax(logits / T) above the token, summed from the probabilities. The previous
implementation (`PreviousHead`, kept here as the baseline) made a new tensor for every [chunk, V]
pass (the product, logsumexp's own temporary, the probabilities, the mask); the shipped one writes
every pass into three buffers made once. Timed on random states of a model of `--hidden` width
(64: the tiny target's):
- `logprobs`, `previous logprobs`: `token_logprobs` without a nucleus;
- `nucleus T=1`, `nucleus T=0.8` and their `previous`: with a top_p 0.95 nucleus.
Both must give the same log-probabilities (to 1e-5) and count the same tokens (asserted); CPU
seconds of this process (the page faults of fresh tensors are system time), medians of
`--repeats` alternating timings.

    .venv/bin/python benchmarks/nucleus_count.py [--tokens 1024] [--hidden 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "include"))

import torch  # noqa: E402

from eagle3_data.hidden_states.final_norm import rms_norm  # noqa: E402
from eagle3_data.hidden_states.logprobs import LogprobHead  # noqa: E402
from eagle3_data.policy.nucleus import MASS_MARGIN, Nucleus  # noqa: E402

VOCAB = 163_840


class PreviousHead(LogprobHead):
    """`_score` as it was (2026-12-04): a new [chunk, V] tensor for every pass."""

    def _score(self, last, ids, nucleus, answer_from, *, top1):
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = int(ids.numel())
        out = torch.full((n,), float("nan"), dtype=torch.float32)
        outside = torch.zeros(n, dtype=torch.bool) if nucleus is not None else None
        for start in range(0, max(n - 1, 0), self.chunk_tokens):
            end = min(start + self.chunk_tokens, n - 1)
            h = rms_norm(last[start:end].float(), self.norm_weight, self.eps)
            logits = h @ self.head.T
            own = logits.gather(1, ids[start + 1 : end + 1, None])
            lse = torch.logsumexp(logits, dim=-1)
            out[start + 1 : end + 1] = own.squeeze(1) - lse
            first = max(answer_from - 1, start) - start
            if outside is not None and first < end - start:
                logits, own, lse = logits[first:], own[first:], lse[first:]
                above = logits > own + self.logit_margin
                if nucleus.temperature == 1.0:
                    probs = torch.exp(logits - lse[:, None])
                else:
                    probs = torch.softmax(logits / nucleus.temperature, dim=-1)
                mass = probs.masked_fill_(~above, 0.0).sum(dim=-1)
                outside[start + 1 + first : end + 1] = mass >= nucleus.top_p + MASS_MARGIN
        return out, outside, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.repeats = 128, 1
    g = torch.Generator().manual_seed(33)
    norm = (torch.ones(args.hidden), 1e-6)
    head = torch.randn(VOCAB, args.hidden, generator=g) * 0.3
    last = torch.randn(args.tokens, args.hidden, generator=g)
    ids = torch.randint(0, VOCAB, (args.tokens,), generator=g)
    shipped, previous = LogprobHead(norm, head), PreviousHead(norm, head)
    runs = {"logprobs": (shipped, None), "previous logprobs": (previous, None)}
    for t in (1.0, 0.8):
        runs[f"nucleus T={t:g}"] = (shipped, Nucleus(t, 0.95, 0))
        runs[f"previous T={t:g}"] = (previous, Nucleus(t, 0.95, 0))
    times: dict[str, list[float]] = {name: [] for name in runs}
    counted: dict[str, int] = {}
    logprobs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternating: the machine's noise hits every variant alike
            for name, (h, nucleus) in runs.items():
                t0 = time.process_time()
                logprobs[name], outside = h.token_logprobs(last, ids, nucleus)
                times[name].append(time.process_time() - t0)
                if outside is not None:
                    counted[name] = int(outside.sum())
    for name in runs:
        assert torch.allclose(logprobs[name], logprobs["logprobs"], atol=1e-5, rtol=0, equal_nan=True), name
    for t in ("1", "0.8"):
        assert counted[f"nucleus T={t}"] == counted[f"previous T={t}"], counted
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["logprobs"]
    print(f"{args.tokens} positions, H {args.hidden}, V {VOCAB}, {torch.get_num_threads()} threads")
    print("| variant | CPU ms per 1k positions | vs logprobs alone | outside |\n|---|---|---|---|")
    for name, s in med.items():
        print(f"| {name} | {s / args.tokens * 1e6:.0f} | {s / base:.2f} | {counted.get(name, '')} |")
    pairs = {"logprobs": ("previous logprobs", "logprobs")} | {
        f"T={t}": (f"previous T={t}", f"nucleus T={t}") for t in ("1", "0.8")
    }
    print(
        "RATIO nucleus_count previous/shipped: "
        + ", ".join(f"{label} {med[old] / med[new]:.2f}" for label, (old, new) in pairs.items())
    )


if __name__ == "__main__":
    main()
