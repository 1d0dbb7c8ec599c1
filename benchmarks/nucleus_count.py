"""The extraction's per-token log-probabilities with and without the nucleus count, against the
count's previous formula, in the same run (hidden_states/logprobs.py `LogprobHead`).

For a sampled answer the extraction also counts the tokens outside the sampling's nucleus, which
needs, per position, the mass of softmax(logits / T) above the token: a pass over the [chunk, V]
logits (V = 163,840). It was a masked logsumexp beside a second logsumexp of the scaled logits;
it is now the probabilities (softmax of the scaled logits; at temperature 1 from the
log-softmax's own normaliser) summed where they lie above. Timed on random states of a model of
`--hidden` width (64: the tiny target's):
- `logprobs`: `token_logprobs` without a nucleus (the product and the log-softmax);
- `nucleus T=1`, `nucleus T=0.8`: with a top_p 0.95 nucleus, as shipped;
- `previous T=1`, `previous T=0.8`: the same with the previous formula (`PreviousHead`).
Both formulas must count the same tokens (asserted); medians of `--repeats` alternating timings.

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

from eagle3_data.hidden_states.logprobs import LogprobHead  # noqa: E402
from eagle3_data.policy.nucleus import MASS_MARGIN, Nucleus  # noqa: E402

VOCAB = 163_840


class PreviousHead(LogprobHead):
    """`_outside` as it was: exp(logsumexp of the scaled logits above the token - logsumexp of all)."""

    def _outside(self, logits, own, nucleus, lse):
        above = logits > own + self.logit_margin
        scaled = logits / nucleus.temperature
        mass = torch.exp(
            torch.logsumexp(scaled.masked_fill(~above, float("-inf")), dim=-1) - torch.logsumexp(scaled, dim=-1)
        )
        return mass >= nucleus.top_p + MASS_MARGIN


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
    runs = {"logprobs": (shipped, None)}
    for t in (1.0, 0.8):
        runs[f"nucleus T={t:g}"] = (shipped, Nucleus(t, 0.95, 0))
        runs[f"previous T={t:g}"] = (previous, Nucleus(t, 0.95, 0))
    times: dict[str, list[float]] = {name: [] for name in runs}
    counted: dict[str, int] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternating: the machine's noise hits every variant alike
            for name, (h, nucleus) in runs.items():
                t0 = time.perf_counter()
                _, outside = h.token_logprobs(last, ids, nucleus)
                times[name].append(time.perf_counter() - t0)
                if outside is not None:
                    counted[name] = int(outside.sum())
    for t in ("1", "0.8"):
        assert counted[f"nucleus T={t}"] == counted[f"previous T={t}"], counted
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["logprobs"]
    print(f"{args.tokens} positions, H {args.hidden}, V {VOCAB}, {torch.get_num_threads()} threads")
    print("| variant | ms per 1k positions | vs logprobs alone | outside |\n|---|---|---|---|")
    for name, s in med.items():
        print(f"| {name} | {s / args.tokens * 1e6:.0f} | {s / base:.2f} | {counted.get(name, '')} |")
    print(
        "RATIO nucleus_count previous/shipped: "
        + ", ".join(f"T={t} {med[f'previous T={t}'] / med[f'nucleus T={t}']:.2f}" for t in ("1", "0.8"))
    )


if __name__ == "__main__":
    main()
