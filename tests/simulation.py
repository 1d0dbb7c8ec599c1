"""What the simulation tests of the policy check (tests/unit/test_policy_*.py) allow a stated rate
to miss by: an observed rejection rate over many seeds is binomial around the true one."""

from __future__ import annotations

import math


def slack(p: float, trials: int) -> float:
    """3 standard deviations of a rate `p` observed over `trials` independent seeds."""
    return 3 * math.sqrt(p * (1 - p) / trials)
