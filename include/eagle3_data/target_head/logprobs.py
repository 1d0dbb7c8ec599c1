"""The target's log-probability of every token, from the extraction's own last state.

The extraction already runs the target over every merged token; one LM-head product more per
token (its final RMSNorm, then [H] x [H, V]) gives the log-probability of each token given
everything before it. That number proves the extraction and the data at once, for every row:
for a local answer it must equal the engine's own log-probability from generation (states
shifted by a position, a batch-mate's states, a prefix cache that shortened them or the wrong
last layer all move it), and over the overflow answers it is the policy check on every row.
At Kimi-K2.5's size the product is 2 x 163840 x 7168 = 2.35 GFLOP per token against ~64 GFLOP
for the forward of its 32 B active parameters: ~3.5% of the extraction's compute.

Position i holds log p(ids[i] | ids[:i]); position 0, which nothing predicts, is NaN. Each
sample is computed alone in chunks of `chunk_tokens` positions from its own start, so its values
depend only on its own states, never on how samples were batched or packed into shards, and the
[chunk, V] logits (163840 wide: 168 MB in fp32 at 256 positions) stay a bounded buffer.

The same logits say, for a sampled answer, whether each of its tokens lies in the nucleus its
sampling allowed (`nucleus.Nucleus`): the extraction counts them on every merged row
(reported by publish, not gated: policy_check `every_row_gate`); the gated nucleus test counts the
same from the local engine's top-K at scoring (nucleus). Both engines truncate the
distribution after temperature: vLLM's sampler applies temperature, then top-k/top-p
(v1/sample/sampler.py `sample`: apply_temperature, then topk_topp_sampler; ops/topk_topp_sampler.py
`apply_top_k_top_p_pytorch` removes a token when the ascending cumulative mass up to it is <= 1 - p,
i.e. keeps it iff the mass strictly above it is < p); SGLang divides the logits by the temperature,
softmaxes, then truncates the probabilities (srt/layers/sampler.py: `logits.div_(temperatures)`,
`top_k_top_p_sampling_from_probs`; its torch fallback drops a token when the mass above it is > p).
So a token sampled honestly at temperature T and top_p p has less than p (at most p for SGLang) of
softmax(logits / T) strictly above it, and, with top_k k, fewer than k tokens above it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_data.errors import UserError
from eagle3_data.nucleus import LOGIT_MARGIN, MASS_MARGIN, Nucleus
from eagle3_data.target_head.final_norm import checkpoint_weight, rms_norm

CHUNK_TOKENS = 256
SUM_FLOOR = 1e-30  # a row's unshifted sum of exps below this is done again shifted (`LogprobHead._exp_sum`)
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # compute dtypes whose head stays in them on CUDA


def lm_head_weight(model_dir: str | Path) -> torch.Tensor:
    """The LM head's weight [V, H], read from the checkpoint alone (`lm_head.weight`,
    `language_model.lm_head.weight` for Kimi-K2.5), else, for a model whose config ties it to the
    input embedding, `model.embed_tokens.weight`."""
    weight = checkpoint_weight(model_dir, ("lm_head.weight",))
    if weight is None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if (cfg.get("text_config") or cfg).get("tie_word_embeddings", cfg.get("tie_word_embeddings")):
            weight = checkpoint_weight(model_dir, ("model.embed_tokens.weight",))
    if weight is None:
        raise UserError(f"model {model_dir}: no LM head weight (*lm_head.weight, or tied embeddings) in the checkpoint")
    return weight


class LogprobHead:
    """The final norm and the LM head on `device`, applied to one sample's last states: the norm
    in fp32; the head's product in fp32, or, on CUDA at a half compute dtype, with the head kept
    in that dtype and the normed state rounded to it (as the engine's own head takes them), the
    products accumulated and the logits returned in fp32 (`torch.mm(..., out_dtype=float32)`).
    Measured on an H200 at Kimi-K2.5's width (H 7168, a 4-layer model whose head is 40% of its
    FLOPs; benchmarks/gpu_extract.py on an H200): with the fp32 product the log-probabilities cost
    +55% of the extraction, with this one +10%, and they agree with transformers' own forward
    alike (worst per-sample mean |difference| 0.016 nats either way): the state's rounding is
    the engine's own, and the logits are not rounded."""

    def __init__(
        self,
        final_norm: tuple[torch.Tensor, float] | None,
        lm_head: torch.Tensor,
        *,
        device: str | torch.device = "cpu",
        chunk_tokens: int = CHUNK_TOKENS,
        compute_dtype: str = "float32",
    ):
        self.device = torch.device(device)
        # None: the states are already after the final norm (SpecForge's layout; exports/check.py)
        self.norm_weight = None if final_norm is None else final_norm[0].detach().to(self.device, torch.float32)
        self.eps = None if final_norm is None else float(final_norm[1])
        half = HALF.get(compute_dtype) if self.device.type == "cuda" else None
        self.head = lm_head.detach().to(self.device, half or torch.float32)
        self.chunk_tokens = chunk_tokens
        self.logit_margin = LOGIT_MARGIN.get(compute_dtype, LOGIT_MARGIN["bfloat16"])
        self._chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `_buffers`, made on first use

    @torch.inference_mode()
    def token_logprobs(
        self,
        last: torch.Tensor,
        ids: Sequence[int] | torch.Tensor,
        nucleus: Nucleus | None = None,
        answer_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 [T] on the CPU: NaN, then log p(ids[i] | ids[:i]) for i >= 1, from `last`
        [T, H], the last layer's output before the final norm. With `nucleus`, also bool [T]: True
        where ids[i], i >= max(1, answer_from) (the sampled answer), lies outside the nucleus of
        softmax(logits / temperature) (module docstring, margins above); None without."""
        out, outside, _ = self._score(last, ids, nucleus, answer_from, top1=False)
        return out, outside

    @torch.inference_mode()
    def token_logprobs_and_top1(
        self, last: torch.Tensor, ids: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_logprobs` and bool [T]: True where ids[i], i >= 1, is the argmax (no other id's
        logit above it) of the distribution the state before it gives."""
        out, _, top1 = self._score(last, ids, None, 0, top1=True)
        return out, top1

    def _score(
        self, last: torch.Tensor, ids, nucleus: Nucleus | None, answer_from: int, *, top1: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One pass over the chunks for both public methods: the logits are the cost. Every [chunk,
        V] pass writes into the head's own buffers (`_buffers`), never a new tensor: on the CPU a
        fresh 168 MB tensor is a fresh mmap that the kernel zero-fills page by page, which cost
        more than the arithmetic (benchmarks/nucleus_count.py)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = int(ids.numel())
        if last.shape[0] != n:
            raise ValueError(f"{last.shape[0]} last states for {n} ids")
        out = torch.full((n,), float("nan"), dtype=torch.float32)
        outside = torch.zeros(n, dtype=torch.bool) if nucleus is not None else None
        best = torch.zeros(n, dtype=torch.bool) if top1 else None
        for start in range(0, max(n - 1, 0), self.chunk_tokens):
            end = min(start + self.chunk_tokens, n - 1)
            logits, work, below = self._buffers(end - start)
            h = last[start:end].to(self.device, torch.float32)
            if self.norm_weight is not None:
                h = rms_norm(h, self.norm_weight, self.eps)
            self._logits(h, logits)
            nxt = ids[start + 1 : end + 1].to(self.device)
            own = logits.gather(1, nxt[:, None])
            total, shift = self._exp_sum(logits, 1.0, work)  # the log-softmax's normaliser
            lse = total.log() if shift is None else shift + total.log()
            out[start + 1 : end + 1] = (own - lse).squeeze(1).cpu()
            if best is not None:
                best[start + 1 : end + 1] = (own >= logits.amax(dim=-1, keepdim=True)).squeeze(1).cpu()
            first = max(answer_from - 1, start) - start  # the chunk's first row predicting an answer token
            if outside is not None and first < end - start:
                rows = slice(first, None)
                far = self._outside(
                    logits[rows],
                    own[rows],
                    nucleus,
                    work[rows],
                    total[rows],
                    None if shift is None else shift[rows],
                    below[rows],
                )
                outside[start + 1 + first : end + 1] = far.cpu()
        return out, outside, best

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, V] views of the head's three chunk buffers (the logits, fp32 work, a bool mask),
        made once at `chunk_tokens` rows on first use."""
        if self._chunk is None:
            shape = (self.chunk_tokens, self.head.shape[0])
            self._chunk = (
                torch.empty(shape, dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.bool, device=self.device),
            )
        return tuple(b[:rows] for b in self._chunk)

    def _exp_sum(
        self, logits: torch.Tensor, temperature: float, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """exp(`logits` / `temperature`) written into `out`, and its sum per row [c, 1], with the
        shift subtracted from every logit before its exp ([c, 1], or None for none). Unshifted
        first: a log-softmax needs no shift while no exp overflows and a row's sum stays a normal
        float, and skipping the row max and the subtraction (two passes over the [c, V] logits)
        takes a fifth off the head's time on the CPU (benchmarks/nucleus_count.py). A chunk
        whose sum left [SUM_FLOOR, inf) (a logit over ~88 overflows fp32's exp; every term tiny
        loses the precision of normal floats) is done again shifted by its row max, as
        torch.logsumexp does. Above the floor the terms that underflow change the sum by less than
        V x 1.4e-45 / 1e-30 (relative), and each exp keeps fp32's relative precision either way."""
        scaled = logits if temperature == 1.0 else torch.div(logits, temperature, out=out)
        total = torch.exp(scaled, out=out).sum(dim=-1, keepdim=True)
        if bool(((total >= SUM_FLOOR) & (total < float("inf"))).all()):
            return total, None
        scaled = logits if temperature == 1.0 else torch.div(logits, temperature, out=out)
        shift = scaled.amax(dim=-1, keepdim=True)
        return torch.sub(scaled, shift, out=out).exp_().sum(dim=-1, keepdim=True), shift

    def _logits(self, h: torch.Tensor, into: torch.Tensor) -> None:
        if self.head.dtype == torch.float32:
            torch.mm(h, self.head.T, out=into)
        else:
            into.copy_(torch.mm(h.to(self.head.dtype), self.head.T, out_dtype=torch.float32))

    def _outside(
        self,
        logits: torch.Tensor,
        own: torch.Tensor,
        nucleus: Nucleus,
        exps: torch.Tensor,
        total: torch.Tensor,
        shift: torch.Tensor | None,
        below: torch.Tensor,
    ) -> torch.Tensor:
        """Per row, whether the token whose logit is `own` [c, 1] lies outside the nucleus of
        softmax(`logits` [c, V] / T): the mass of the tokens clearly above it (by LOGIT_MARGIN)
        is >= top_p + MASS_MARGIN, or top_k or more tokens are clearly above it. With top_k, vLLM
        takes top_p of the top-k renormalised: that mass is at least the full distribution's
        mass above, so the full one is the conservative side (never counts an honest token).
        `exps`: exp(`logits` - `shift`) (`_exp_sum`), summing to `total` per row (the
        log-softmax's own), overwritten here; `below`: a bool buffer of its shape. The mass is the
        probabilities summed where they lie above, not a masked logsumexp beside a second one (the
        same mass to ~1e-6, far inside MASS_MARGIN). On the CPU each row's exps at or below the
        exp of its threshold are zeroed in one pass (`threshold_`: exp is monotonic, so the same
        tokens), where a [c, V] comparison into `below` and a masked fill took 5x as long
        (benchmarks/nucleus_count.py); on a GPU, where a launch per row would cost more than the
        pass, the comparison and the fill stay."""
        threshold = own + self.logit_margin  # above: a logit over this
        on_cpu = self.device.type == "cpu"
        if not on_cpu or nucleus.top_k > 0:
            torch.le(logits, threshold, out=below)
        if nucleus.temperature != 1.0:  # softmax(logits / T), unnormalised, in the same buffer
            total, shift = self._exp_sum(logits, nucleus.temperature, exps)
            threshold = threshold / nucleus.temperature
        if on_cpu:
            cuts = (threshold if shift is None else threshold - shift).exp_().squeeze(1).tolist()
            for row, cut in zip(exps, cuts):
                torch.nn.functional.threshold_(row, cut, 0.0)  # kept where exp > cut: logit above
        else:
            exps.masked_fill_(below, 0.0)
        mass = exps.sum(dim=-1, keepdim=True).div_(total).squeeze(1)
        far = mass >= nucleus.top_p + MASS_MARGIN if nucleus.top_p < 1.0 else torch.zeros_like(mass, dtype=torch.bool)
        if nucleus.top_k > 0:
            far |= below.shape[1] - below.sum(dim=-1) >= nucleus.top_k
        return far


class LogprobStats:
    """What a shard's summary says of its log-probabilities, per source (the merged record's
    `source`: sglang | vllm | openrouter): per sample the mean over its trained tokens (loss mask
    1), their sum and count (so shards add up), a histogram of the per-sample means, and the least
    likely samples (the likeliest garbage, for a person to read); and, over the sampled answers
    whose sampling had a nucleus, how many answer tokens were checked and how many lay outside it
    (`nucleus`: the nucleus test's counts, which add up over shards like the sums)."""

    BINS = tuple(float(b) for b in range(-20, 1))  # per-sample mean log-probability, nats: edges -20..0

    def __init__(self, worst: int = 5):
        self.worst = worst
        self.sides: dict[str, dict[str, Any]] = {}
        self.nucleus: dict[str, dict[str, Any]] = {}  # per source: samples, tokens checked, outside, samples_outside

    WORST_TOKENS = 64  # of a least likely sample, its first trained ids kept (the report decodes them)

    def add(
        self,
        sample_id: str,
        token_logprobs: torch.Tensor,
        loss_mask: Sequence[int],
        source: str | None = None,
        greedy: bool = False,
        ids: Sequence[int] | None = None,
        outside: torch.Tensor | None = None,
        answer_from: int = 0,
    ) -> None:
        """`greedy`: a calibration answer (temperature 0), counted but kept out of the sampled
        answers' means the every-row policy check compares (policy_check: greedy text is far
        likelier under the target than sampled text). `ids`: the sample's ids, so that the least
        likely samples carry their first trained ids and log-probabilities for a person to read.
        `outside` (`LogprobHead.token_logprobs` with a nucleus): the trained tokens from
        `answer_from` on (the sampled answer) are counted into the nucleus test's figures."""
        trained = torch.as_tensor(loss_mask, dtype=torch.bool) & ~torch.isnan(token_logprobs)
        if not trained.any():
            return
        if outside is not None:
            self._add_nucleus(source or "unknown", sample_id, outside, trained, answer_from)
        values = token_logprobs[trained].double()
        mean = float(values.mean())
        side = self.sides.setdefault(
            source or "unknown",
            {
                "samples": 0,
                "trained_tokens": 0,
                "sum_trained_logprob": 0.0,
                "histogram": [0] * (len(self.BINS) + 1),
                "means": [],
                "sampled_means": [],
                "worst": [],
            },
        )
        if ids is not None and (len(side["worst"]) < self.worst or (mean, sample_id) < side["worst"][-1][:2]):
            kept = torch.as_tensor(ids, dtype=torch.long)[trained][: self.WORST_TOKENS]
            side["worst"] = sorted(
                side["worst"]
                + [(mean, sample_id, kept.tolist(), [float(x) for x in token_logprobs[trained][: self.WORST_TOKENS]])]
            )[: self.worst]
        side["samples"] += 1
        side["trained_tokens"] += int(values.numel())
        side["sum_trained_logprob"] += float(values.sum())
        side["histogram"][sum(mean >= b for b in self.BINS)] += 1  # bin k: [BINS[k-1], BINS[k]); 0: below -20
        side["means"].append((mean, sample_id))
        if not greedy:
            side["sampled_means"].append(mean)

    SHOWN_OUTSIDE = 20  # sample ids with tokens outside the nucleus, per source, kept for a person to read

    def _add_nucleus(
        self, source: str, sample_id: str, outside: torch.Tensor, trained: torch.Tensor, answer_from: int
    ) -> None:
        checked = trained.clone()
        checked[: max(answer_from, 1)] = False
        n, k = int(checked.sum()), int((outside & checked).sum())
        if not n:
            return
        acc = self.nucleus.setdefault(source, {"samples": 0, "tokens": 0, "outside": 0, "samples_outside": []})
        acc["samples"] += 1
        acc["tokens"] += n
        acc["outside"] += k
        if k:
            acc["samples_outside"] = sorted(acc["samples_outside"] + [[sample_id, k, n]])[: self.SHOWN_OUTSIDE]

    def summary(self) -> dict[str, Any]:
        sides = {}
        for source, side in sorted(self.sides.items()):
            worst = sorted(side["means"])[: self.worst]
            kept = {sid: (ids, lps) for _, sid, ids, lps in side["worst"]}
            sides[source] = {k: v for k, v in side.items() if k not in ("means", "worst")} | {
                "least_likely_samples": [
                    {"sample_id": sid, "mean_logprob": m}
                    | ({"ids": kept[sid][0], "logprobs": kept[sid][1]} if sid in kept else {})
                    for m, sid in worst
                ]
            }
            if source in self.nucleus:
                sides[source]["nucleus"] = self.nucleus[source]
        tokens = sum(s["trained_tokens"] for s in sides.values())
        total = sum(s["sum_trained_logprob"] for s in sides.values())
        return {
            "trained_tokens": tokens,
            "sum_trained_logprob": total,
            "mean_trained_logprob": total / tokens if tokens else None,
            "histogram_edges": list(self.BINS),
            "sources": sides,
        }
