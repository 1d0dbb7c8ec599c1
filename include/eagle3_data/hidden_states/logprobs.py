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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_data.errors import UserError
from eagle3_data.hidden_states.final_norm import checkpoint_weight, rms_norm

CHUNK_TOKENS = 256


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
    """The final norm and the LM head, in fp32 on `device`, applied to one sample's last states."""

    def __init__(
        self,
        final_norm: tuple[torch.Tensor, float],
        lm_head: torch.Tensor,
        *,
        device: str | torch.device = "cpu",
        chunk_tokens: int = CHUNK_TOKENS,
    ):
        self.device = torch.device(device)
        self.norm_weight = final_norm[0].detach().to(self.device, torch.float32)
        self.eps = float(final_norm[1])
        self.head = lm_head.detach().to(self.device, torch.float32)
        self.chunk_tokens = chunk_tokens

    @torch.inference_mode()
    def token_logprobs(self, last: torch.Tensor, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """float32 [T] on the CPU: NaN, then log p(ids[i] | ids[:i]) for i >= 1, from `last`
        [T, H], the last layer's output before the final norm."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = int(ids.numel())
        if last.shape[0] != n:
            raise ValueError(f"{last.shape[0]} last states for {n} ids")
        out = torch.full((n,), float("nan"), dtype=torch.float32)
        for start in range(0, max(n - 1, 0), self.chunk_tokens):
            end = min(start + self.chunk_tokens, n - 1)
            h = rms_norm(last[start:end].to(self.device, torch.float32), self.norm_weight, self.eps)
            logits = h @ self.head.T  # [chunk, V]
            nxt = ids[start + 1 : end + 1].to(self.device)
            picked = logits.gather(1, nxt[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            out[start + 1 : end + 1] = picked.cpu()
        return out


class LogprobStats:
    """What a shard's summary says of its log-probabilities, per source (the merged record's
    `source`: sglang | vllm | openrouter): per sample the mean over its trained tokens (loss mask
    1), their sum and count (so shards add up), a histogram of the per-sample means, and the least
    likely samples (the likeliest garbage, for a person to read)."""

    BINS = tuple(float(b) for b in range(-20, 1))  # per-sample mean log-probability, nats: edges -20..0

    def __init__(self, worst: int = 5):
        self.worst = worst
        self.sides: dict[str, dict] = {}

    WORST_TOKENS = 64  # of a least likely sample, its first trained ids kept (the report decodes them)

    def add(
        self,
        sample_id: str,
        token_logprobs: torch.Tensor,
        loss_mask: Sequence[int],
        source: str | None = None,
        greedy: bool = False,
        ids: Sequence[int] | None = None,
    ) -> None:
        """`greedy`: a calibration answer (temperature 0), counted but kept out of the sampled
        answers' means the every-row policy check compares (policy.compare: greedy text is far
        likelier under the target than sampled text). `ids`: the sample's ids, so that the least
        likely samples carry their first trained ids and log-probabilities for a person to read."""
        trained = torch.as_tensor(loss_mask, dtype=torch.bool) & ~torch.isnan(token_logprobs)
        if not trained.any():
            return
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

    def summary(self) -> dict:
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
        tokens = sum(s["trained_tokens"] for s in sides.values())
        total = sum(s["sum_trained_logprob"] for s in sides.values())
        return {
            "trained_tokens": tokens,
            "sum_trained_logprob": total,
            "mean_trained_logprob": total / tokens if tokens else None,
            "histogram_edges": list(self.BINS),
            "sources": sides,
        }
