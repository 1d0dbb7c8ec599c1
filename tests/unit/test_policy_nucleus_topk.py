"""The nucleus test's top-K rule (nucleus.py `outside`) against the exact rule on full logits.

The oracle is vLLM's own truncation written out here with torch on the whole distribution
(v1/sample/ops/topk_topp_sampler.py:473-514 `apply_top_k_top_p_pytorch`, after the temperature:
sort ascending, top-k masks what lies below the k-th logit, top-p removes where the cumulative
softmax is <= 1 - p, the likeliest always kept). The rule sees only what an engine returns: the
log_softmax of the raw logits in fp32, the token's own value and the K largest. It must never call
a token outside that vLLM keeps, at any K, temperature below, at or above 1, with top_p or top_k;
and where the top-K covers the nucleus it must call outside every token vLLM removes beyond the
rule's stated margins.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_data.nucleus import ENGINE_LOGIT_MARGIN, Nucleus, outside

V = 1024
ROWS = 16
PER_ROW = 64  # tokens checked per row, spread over every rank


def _logits() -> torch.Tensor:
    """Rows of raw logits from flat (most of the vocabulary in the nucleus) to peaked."""
    g = torch.Generator().manual_seed(2929)
    scale = torch.linspace(1.0, 6.0, ROWS, dtype=torch.float64)[:, None]
    return torch.randn(ROWS, V, generator=g, dtype=torch.float64) * scale


def _vllm_keeps(logits: torch.Tensor, nucleus: Nucleus) -> torch.Tensor:
    """bool [rows, V]: what vLLM's sampler may emit at `nucleus`, on the full distribution."""
    x = logits / nucleus.temperature
    sort, idx = x.sort(dim=-1, descending=False)
    if nucleus.top_k > 0:
        kth = sort.gather(1, torch.full((sort.shape[0], 1), sort.shape[1] - nucleus.top_k))
        sort = sort.masked_fill(sort < kth, float("-inf"))
    if nucleus.top_p < 1.0:
        cum = sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - nucleus.top_p
        mask[:, -1] = False
        sort = sort.masked_fill(mask, float("-inf"))
    return torch.empty_like(sort).scatter_(1, idx, sort) > float("-inf")


def _clearly_removed(logits: torch.Tensor, nucleus: Nucleus, band: float) -> torch.Tensor:
    """bool [rows, V]: tokens vLLM removes with room to spare: the tokens above them by more than the
    rule's logit margin hold at least top_p + `band` of softmax(logits / T) (top_p), or k or more
    tokens lie above them by that margin (top_k)."""
    q = (logits / nucleus.temperature).softmax(dim=-1)
    asc, idx = logits.sort(dim=-1)  # per token, the ids above it by the margin: a suffix of the ascending order
    first_above = torch.searchsorted(asc, logits + ENGINE_LOGIT_MARGIN, right=True)
    n_above = V - first_above
    tail = torch.cat([q.gather(1, idx).flip(-1).cumsum(-1).flip(-1), torch.zeros(q.shape[0], 1, dtype=q.dtype)], 1)
    mass_above = tail.gather(1, first_above)
    out = torch.zeros_like(logits, dtype=torch.bool)
    if nucleus.top_p < 1.0:
        out |= mass_above >= nucleus.top_p + band
    if nucleus.top_k > 0:
        out |= n_above >= nucleus.top_k
    return out


def _checked_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows, PER_ROW] token ids per row, at ranks spread from the top to the bottom (log-spaced)."""
    ranks = torch.unique(torch.logspace(0, np.log10(V), PER_ROW).long().clamp(max=V) - 1)
    order = logits.argsort(dim=-1, descending=True)
    return order[:, ranks]


def _rule(logits: torch.Tensor, tokens: torch.Tensor, nucleus: Nucleus, k: int) -> torch.Tensor:
    """The rule on what an engine returns: fp32 log_softmax of the raw logits, own value and top-K."""
    lp = torch.log_softmax(logits.float(), dim=-1).double()
    own = lp.gather(1, tokens)
    top = lp.topk(k, dim=-1).values[:, None, :].expand(-1, tokens.shape[1], -1)
    far = outside(own.reshape(-1).numpy(), top.reshape(-1, k).numpy(), nucleus, V)
    return torch.from_numpy(far).reshape(tokens.shape)


NUCLEI = [
    Nucleus(1.0, 0.95),
    Nucleus(0.7, 0.9),
    Nucleus(1.3, 0.95),
    Nucleus(1.0, 1.0, 40),
    Nucleus(0.8, 0.9, 20),
]


@pytest.mark.parametrize("nucleus", NUCLEI, ids=lambda n: f"T{n.temperature}-p{n.top_p}-k{n.top_k}")
@pytest.mark.parametrize("k", [5, 20, 200, V])
def test_never_outside_where_vllm_keeps_the_token(nucleus, k):
    logits = _logits()
    tokens = _checked_tokens(logits)
    keeps = _vllm_keeps(logits, nucleus).gather(1, tokens)
    far = _rule(logits, tokens, nucleus, k)
    assert not (far & keeps).any(), [(r, int(tokens[r, c])) for r, c in (far & keeps).nonzero().tolist()][:5]
    if k == V:  # the whole distribution: the rule has every token it needs, and sees the removed ones
        assert far.any() and (~keeps).any()


@pytest.mark.parametrize("nucleus", NUCLEI, ids=lambda n: f"T{n.temperature}-p{n.top_p}-k{n.top_k}")
def test_outside_every_clearly_removed_token_when_the_top_k_covers_the_nucleus(nucleus):
    """K = V: the top-K is the distribution. Tokens removed beyond the margins (a mass band of 0.4 x
    (1 - top_p) over top_p: the rule's MASS_MARGIN, the odds room for the engines' logit
    differences and the rest-mass slack) are all outside; at temperature 1 and below, a top-K
    holding the nucleus with that room (K = 400 here, on the peaked rows) finds the same tokens."""
    logits = _logits()
    tokens = _checked_tokens(logits)
    band = 0.4 * (1 - nucleus.top_p)  # 0.02 at top_p 0.95: the rule asks for 0.961 at T 1, 0.922 at T 0.7 and p 0.9
    clear = _clearly_removed(logits, nucleus, band).gather(1, tokens)
    assert clear.sum() >= 50, int(clear.sum())  # the test sees many such tokens
    far = _rule(logits, tokens, nucleus, V)
    missed = clear & ~far
    assert not missed.any(), [(r, int(tokens[r, c])) for r, c in missed.nonzero().tolist()][:5]
    if nucleus.temperature <= 1.0:
        q = (logits / nucleus.temperature).softmax(-1).sort(dim=-1, descending=True).values
        # rows whose top-400 hold the nucleus with room (top_k alone: every row, 400 >= k)
        covered = q[:, :400].sum(-1) >= nucleus.top_p + band if nucleus.top_p < 1 else torch.ones(ROWS, dtype=bool)
        assert covered.sum() >= 4, int(covered.sum())
        far = _rule(logits, tokens, nucleus, 400)
        missed = clear & ~far & covered[:, None]
        assert not missed.any(), [(r, int(tokens[r, c])) for r, c in missed.nonzero().tolist()][:5]


def test_a_top_k_narrower_than_the_nucleus_only_loses_power():
    """A flat row: its top_p 0.95 nucleus holds most of the vocabulary; with K = 20 nothing can
    be called outside (the rest of the mass may lie anywhere), though vLLM removes ~5% of it."""
    logits = _logits()[:1]
    nucleus = Nucleus(1.0, 0.95)
    tokens = _checked_tokens(logits)
    assert not _vllm_keeps(logits, nucleus).gather(1, tokens).all()
    assert not _rule(logits, tokens, nucleus, 20).any()
