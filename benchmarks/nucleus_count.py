"""The extraction's per-token log-probabilities with and without the nucleus count, as shipped
against the previous implementation of the same formulas, in the same run
(target_head/logprobs.py `LogprobHead`).

For every position the extraction takes the LM head's [chunk, V] logits (V = 163,840) and their
log-softmax; for a sampled answer it also counts the tokens outside the sampling's nucleus: the
mass of softmax(logits / T) above the token, summed from the probabilities. The previous
implementation (`PreviousHead`, kept here as the baseline) shifted every chunk by its row max
before the exp, as torch.logsumexp does, and found the tokens above by a [chunk, V] comparison and
a masked fill; the shipped one sums the exps unshifted and shifts only a chunk whose sum left
fp32's safe range (`LogprobHead._exp_sum`; tests/unit/test_logprob_head.py has the logits where it
must), and on the CPU zeroes each row's exps below its threshold in one pass. An earlier baseline,
a new tensor for every [chunk, V] pass, is in the benchmark log of 2026-12-05 (git history,
measured under `make test`). Timed on random states of a model of `--hidden` width (64: the tiny
target's):
- `logprobs`, `previous logprobs`: `token_logprobs` without a nucleus;
- `nucleus T=1`, `nucleus T=0.8` and their `previous`: with a top_p 0.95 nucleus.
Both must give the same log-probabilities (to 1e-5) and count the same tokens (asserted); CPU
seconds of this process, medians of `--repeats` alternating timings.

    .venv/bin/python benchmarks/nucleus_count.py [--tokens 1024] [--hidden 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "include"))

import torch

from eagle3_data.nucleus import MASS_MARGIN, Nucleus
from eagle3_data.target_head.logprobs import LogprobHead

VOCAB = 163_840


class PreviousHead(LogprobHead):
    """`LogprobHead` as it was until 2026-12-05: every chunk's normaliser shifted by its row max
    (a max pass and a subtraction over the [chunk, V] logits before the exp), and the nucleus
    count's tokens above by a [chunk, V] comparison and a masked fill."""

    def _exp_sum(self, logits, temperature, out):
        scaled = logits if temperature == 1.0 else torch.div(logits, temperature, out=out)
        shift = scaled.amax(dim=-1, keepdim=True)
        return torch.sub(scaled, shift, out=out).exp_().sum(dim=-1, keepdim=True), shift

    def _outside(self, logits, own, nucleus, exps, total, shift, below):
        """A [c, V] comparison into `below` and a masked fill, on every device."""
        torch.le(logits, own + self.logit_margin, out=below)
        if nucleus.temperature != 1.0:
            total, _ = self._exp_sum(logits, nucleus.temperature, exps)
        mass = exps.masked_fill_(below, 0.0).sum(dim=-1, keepdim=True).div_(total).squeeze(1)
        far = mass >= nucleus.top_p + MASS_MARGIN if nucleus.top_p < 1.0 else torch.zeros_like(mass, dtype=torch.bool)
        if nucleus.top_k > 0:
            far |= below.shape[1] - below.sum(dim=-1) >= nucleus.top_k
        return far


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
