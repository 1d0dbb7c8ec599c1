"""What an extraction will write, per token and in all, before the GPU stage runs.

Per token, with H the target's hidden size and 3 aux layers (docs/hidden_states.md, "Layouts"):
our shards hold 3H aux values + H for the last state, plus ids, mask, the target's fp32
log-probability (logprobs.py) and (fp8) one fp32 scale per aux layer; speculators' files hold the same 4H
(fp8: one fp32 scale per token); SpecForge's
.ckpt the same 4H in the trainer's dtype. At Kimi-K2.5's H = 7168 that is ~57 KB per token in
bf16: ~8 TB for 145 M tokens. The plan logs this for the configured model and the publish
summary records it beside what was written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3_data.runs.run import Run

ID_BYTES = 4 + 1  # int32 input id + uint8 loss mask per token
LOGPROB_BYTES = 4  # the target's float32 log-probability per token (target_head.logprobs)


def bytes_per_token(
    hidden_size: int, *, aux_layers: int = 3, last: bool = True, logprobs: bool = True
) -> dict[str, float]:
    """Bytes per token of each layout we write, by storage encoding."""
    aux, last_n = aux_layers * hidden_size, hidden_size if last else 0
    ours = ID_BYTES + (LOGPROB_BYTES if logprobs else 0)
    return {
        "shards_bf16": 2 * (aux + last_n) + ours,
        "shards_fp32": 4 * (aux + last_n) + ours,
        "shards_fp8": aux + 4 * aux_layers + 2 * last_n + ours,  # fp8 aux + row scales, bf16 last
        "speculators_bf16": 2 * (aux + last_n) + 8,  # + token_ids int64
        "speculators_fp8": (aux + last_n) + 4 + 8,  # + one fp32 scale, token_ids
        "specforge_bf16": 2 * (aux + last_n) + 16,  # + input_ids, loss_mask int64
    }


def estimate(
    tokens: int, hidden_size: int, *, aux_layers: int = 3, last: bool = True, logprobs: bool = True
) -> dict[str, Any]:
    """{hidden_size, tokens, bytes_per_token: {...}, bytes: {...}} for `tokens` merged tokens."""
    per = bytes_per_token(hidden_size, aux_layers=aux_layers, last=last, logprobs=logprobs)
    return {
        "hidden_size": hidden_size,
        "tokens": tokens,
        "bytes_per_token": per,
        "bytes": {k: int(v * tokens) for k, v in per.items()},
    }


def describe(est: dict[str, Any]) -> str:
    """One line for the log: `145,000,000 tokens at H=7168: shards_bf16 8.31 TB, ...`."""
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in est["bytes"].items())
    return f"{est['tokens']:,} tokens at H={est['hidden_size']}: {parts}"


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as disks are sold)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"


def storage_estimate(run: Run, tokens: int) -> dict[str, Any] | None:
    """The bytes the extraction writes for the configured model (its config.json's hidden size)
    in each layout and dtype; None when the model's config cannot be read on this worker (an
    s3:// or hub source, a path only the GPU nodes mount): an estimate missing is no failure."""
    import json
    from pathlib import Path

    from eagle3_data.config import resolve_source
    from eagle3_data.errors import UserError

    h = run.config.hidden_states
    try:
        cfg = json.loads((Path(resolve_source(run.config.model.source)) / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return None
    hidden = (cfg.get("text_config") or cfg).get("hidden_size")
    if not isinstance(hidden, int):
        return None
    return estimate(
        tokens, hidden, aux_layers=len(h.layer_ids) if h.layer_ids else 3, last=h.last_hidden, logprobs=h.logprobs
    )
