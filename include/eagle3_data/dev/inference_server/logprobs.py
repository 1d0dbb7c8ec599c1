"""The log-probabilities `/generate` reports, from the dev server's stand-in model: a fixed
pseudo-random log-probability per (previous id, id), in SGLang's `meta_info` shapes."""

from __future__ import annotations

import math
from typing import Any


def _pair_logprob(previous: int, token: int) -> float:
    """The dev server's stand-in model: a fixed pseudo-random log-probability per (previous id, id)."""
    import hashlib

    u = int.from_bytes(hashlib.blake2b(f"{previous}:{token}".encode(), digest_size=8).digest(), "big") / 2**64
    return -(0.05 + 6.0 * u * u)


def output_logprobs(prompt: list[int], generated: list[int]) -> list[list[Any]]:
    """SGLang's `meta_info.output_token_logprobs` (`[logprob, id, text]` per output id), from the
    stand-in model `_pair_logprob`."""
    ids = list(prompt[-1:]) + list(generated)
    return [[_pair_logprob(ids[i], ids[i + 1]), ids[i + 1], None] for i in range(len(generated))]


def input_logprobs(prompt: list[int], start: int) -> list[list[Any]]:
    """SGLang's `meta_info.input_token_logprobs` from `logprob_start_len` (`[logprob, id, text]`,
    the first entry's logprob None). The values are the dev server's own stand-in model: a fixed
    pseudo-random log-probability per (previous id, id), the same for every text whatever path it
    came by, so local and overflow text of one dev server score alike; a real engine's are the
    model's (tests/engine/test_policy_check.py)."""
    start = max(start, 0)
    return [
        [None if i == start else _pair_logprob(prompt[i - 1], prompt[i]), prompt[i], None]
        for i in range(start, len(prompt))
    ]


def top_logprobs(previous: int, token: int, k: int, ordinary_ids: int) -> list[list[Any]]:
    """One position's `k` likeliest ids as SGLang lists them (`[logprob, id, text]`, descending),
    from the stand-in model: its own text is its likeliest, so `token` comes first with its
    `_pair_logprob`, and the other ids (pseudo-random per (previous id, rank)) share, at most, half
    of what is left, each below it. The values are log-probabilities of one distribution (they
    sum below 1); a token of the stand-in's text is never outside a nucleus. The other ids are
    ordinary ones, below `ordinary_ids` (`ordinary_id_count`)."""
    import hashlib

    own = _pair_logprob(previous, token)
    share = min(math.exp(own), 1.0 - math.exp(own))  # every other id below `token`, and all of them below 1
    out, taken = [[own, token, None]], {token}
    for rank in range(1, k):
        digest = hashlib.blake2b(f"{previous}:top:{rank}".encode(), digest_size=8).digest()
        other = int.from_bytes(digest, "big") % ordinary_ids
        while other in taken:
            other = (other + 1) % ordinary_ids
        taken.add(other)
        out.append([math.log(share / (2 * (rank + 1) ** 2)), other, None])
    return out


def input_top_logprobs(prompt: list[int], start: int, k: int, ordinary_ids: int) -> list[list[Any] | None]:
    """SGLang's `meta_info.input_top_logprobs`: lined up with `input_token_logprobs` (None at
    `logprob_start_len`, then each position's `top_logprobs`)."""
    start = max(start, 0)
    return [
        None if i == start else top_logprobs(prompt[i - 1], prompt[i], k, ordinary_ids)
        for i in range(start, len(prompt))
    ]


def top_num(value: Any, i: int) -> int:
    """`top_logprobs_num` for the batch's i-th prompt (an int, or one per prompt; absent: 0)."""
    if isinstance(value, list):
        return int(value[i]) if i < len(value) else 0
    return int(value or 0)


def ordinary_id_count(tok: Any) -> int:
    """How many ordinary (BPE) ids the tokenizer has: its added (special and tag) tokens sit above
    them, in every family this server stands in for."""
    first_added: int = min(tok.get_added_vocab().values())
    return first_added
