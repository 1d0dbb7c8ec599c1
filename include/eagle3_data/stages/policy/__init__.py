"""The policy check: is the provider's text the target model's?

The identity check (stages/generate/provider_identity.py) compares the names an answer carries; a
provider can serve other weights under the pinned name (a quantisation, an older checkpoint, a
different model). What the names cannot show, the target model itself can: text the target
generated is, token by token, as likely under the target as the target's own text; another
model's text is not. So the local engine scores a sample of the overflow answers, on the ids
reconstruction gave them, and as many local answers, on the ids the same reconstruction would
give them (the validator's rebuild: both sides go through one tokenisation path, so BPE
re-splits cannot move one side only), plus the calibration prompts answered on both paths, and
the gate decides on the samples' mean log-probabilities with a test of stated power
(`compare`: the sampled answers side against side, the calibration prompts as pairs, and the
answer tokens outside the sampling's nucleus, counted from the engine's top log-probabilities).

What it can and cannot prove is in docs/generation.md ("The policy check").

Modules, in flow order: `select` (which samples, and their ids), `score` (the engine requests),
`nucleus` (which answer tokens are provably outside the nucleus, from a request's top-K),
`compare` (the figures and the decision).
"""

from eagle3_data.nucleus import Item
from eagle3_data.policy_check import Thresholds, check, decide, policy_gate, required_samples, summarize
from eagle3_data.stages.policy.score import ScoreEndpoints, ScoreTimings, score_items
from eagle3_data.stages.policy.select import local_items, overflow_items

__all__ = [
    "Item",
    "ScoreEndpoints",
    "ScoreTimings",
    "Thresholds",
    "check",
    "decide",
    "local_items",
    "overflow_items",
    "policy_gate",
    "required_samples",
    "score_items",
    "summarize",
]
