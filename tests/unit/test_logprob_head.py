"""The extraction's LM head (target_head/logprobs.py `LogprobHead`) at logits far from the tiny
target's: large enough that fp32's exp overflows (> ~88), and all so negative that every exp
underflows. Its log-softmax's normaliser skips the row max while neither happens; here both do,
in the log-softmax and in the nucleus count's softmax(logits / T). The oracle is torch's own
log_softmax in float64 of the same logits; for the nucleus, the likeliest token is always kept
and the least likely one, with nearly all the mass above it, lies outside top_p 0.9."""

from __future__ import annotations

import pytest
import torch

from eagle3_data.nucleus import Nucleus
from eagle3_data.target_head.final_norm import rms_norm
from eagle3_data.target_head.logprobs import LogprobHead

V, H, T = 1000, 8, 33
NORM = (torch.ones(H), 1e-6)


def _case(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(states [T, H], head [V, H]) whose logits are ordinary, huge, or all far below zero."""
    g = torch.Generator().manual_seed(7)
    states = torch.randn(T, H, generator=g)
    if kind == "ordinary":
        return states, torch.randn(V, H, generator=g) * 0.3
    if kind == "huge":  # logits' spread ~ 40 x sqrt(H): hundreds
        return states, torch.randn(V, H, generator=g) * 40
    u = torch.nn.functional.normalize(torch.randn(H, generator=g), dim=0)  # every state along u
    states = u.expand(T, H) * torch.rand(T, 1, generator=g).add(0.5) + torch.randn(T, H, generator=g) * 1e-3
    return states, -60 * u + torch.randn(V, H, generator=g)  # every logit ~ -60 sqrt(H) = -170


def _oracle_logits(states: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return rms_norm(states, *NORM).double() @ head.double().T


@pytest.mark.parametrize("kind", ["ordinary", "huge", "far_below_zero"])
@pytest.mark.parametrize("chunk", [256, 5])
def test_token_logprobs_are_torchs_log_softmax_at_any_logit_scale(kind, chunk):
    states, head = _case(kind)
    logits = _oracle_logits(states, head)
    if kind == "huge":
        assert float(logits.amax()) > 100  # fp32's exp overflows there
    if kind == "far_below_zero":
        assert float(logits.amax()) < -95  # every fp32 exp underflows there
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    got, _ = LogprobHead(NORM, head, chunk_tokens=chunk).token_logprobs(states, ids)
    want = torch.log_softmax(logits, dim=-1)[torch.arange(T - 1), ids[1:]]
    assert torch.isnan(got[0])
    torch.testing.assert_close(got[1:].double(), want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("kind", ["ordinary", "huge", "far_below_zero"])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_nucleus_keeps_the_likeliest_and_drops_the_least_likely_at_any_logit_scale(kind, temperature):
    states, head = _case(kind)
    logits = _oracle_logits(states, head)
    likeliest, least = logits.argmax(dim=-1), logits.argmin(dim=-1)
    mass_above_least = 1 - torch.softmax(logits / temperature, dim=-1).gather(1, least[:, None]).squeeze(1)
    assert bool((mass_above_least > 0.95).all())  # clearly outside top_p 0.9 by the oracle
    pick = torch.arange(T - 1) % 2 == 0  # position i + 1 asks for row i's likeliest, else its least likely
    ids = torch.cat([torch.zeros(1, dtype=torch.long), torch.where(pick, likeliest[:-1], least[:-1])])
    got, outside = LogprobHead(NORM, head, chunk_tokens=8).token_logprobs(states, ids, Nucleus(temperature, 0.9, -1))
    assert torch.isfinite(got[1:]).all()
    assert outside[1:].tolist() == (~pick).tolist()
