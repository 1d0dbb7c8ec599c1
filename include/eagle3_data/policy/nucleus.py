"""The nucleus test's counts on the policy check's own items (both sides on one tokenisation path).

The local answers are scored on the ids the overflow path would have given their text (the
validator's rebuild, `select.local_items`), the overflow answers on the ids reconstruction gave
theirs: a token re-split by that path is re-split on both sides alike, so an honest provider's
outside-rate equals the local engine's, and a provider that ignores top_p (or top_k) is the only
thing that raises it. Each item's answer tokens go through the target's last state and LM head
(`hidden_states.logprobs.LogprobHead`, in its bounded chunks), which says for each whether it lies
in the nucleus the run's sampling allows. Only sampled answers count (a calibration answer is
greedy: its route is "both").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from eagle3_data.policy.select import Item

BATCH_TOKENS = 8192  # padded tokens per forward


def nucleus_counts(items: Sequence[Item], sampling: Mapping[str, Any], backend) -> dict[str, dict[str, int]] | None:
    """Per side (local, overflow): sampled answers, answer tokens checked, tokens outside the
    nucleus of `sampling` (the run's generation.sampling), from the target `backend`'s last
    states (a hidden_states backend: the extraction's). None when the sampling has no nucleus to
    check (greedy, no top_p/top_k, or penalties: `Nucleus.of`)."""
    from eagle3_data.hidden_states.extract import plan_batches
    from eagle3_data.hidden_states.logprobs import LogprobHead, Nucleus

    nucleus = Nucleus.of(sampling)
    if nucleus is None:
        return None
    info = backend.describe()
    head = LogprobHead(backend.final_norm, backend.lm_head, device=info.device, compute_dtype=info.dtype)
    sampled = [it for it in items if it.route == it.side and len(it.ids) > it.first]
    counts = {side: {"samples": 0, "tokens": 0, "outside": 0} for side in ("local", "overflow")}
    for batch in plan_batches([len(it.ids) for it in sampled], BATCH_TOKENS):
        states = backend.forward([list(sampled[i].ids) for i in batch], [0], True)
        for i, st in zip(batch, states):
            it = sampled[i]
            _, outside = head.token_logprobs(st.last, it.ids, nucleus, it.first)
            side = counts[it.side]
            side["samples"] += 1
            side["tokens"] += len(it.ids) - max(it.first, 1)
            side["outside"] += int(outside.sum())
    return counts
