"""Backoff for network calls: exponential with full jitter, never shorter than `Retry-After`."""

from __future__ import annotations

import email.utils
import random
import time

# HTTP statuses the same request would get again: this request is wrong (both clients; a local
# engine's 401/403 is an auth proxy's refusal of every request, a dropped endpoint, and the
# overflow client reads 401/403 itself: provider_answers.classify_status).
PERMANENT_STATUS = frozenset({400, 404, 413, 422})
# An endpoint waited for (no connection yet, or a server still loading): a WARNING line on the
# first retry, then one every this many seconds, so a wait of 15 s (or a 10-min warm-up) is never silent.
WAIT_NOTE_EVERY_S = 5.0


def backoff_s(
    attempt: int,
    base_s: float = 0.5,
    cap_s: float = 60.0,
    retry_after: str | None = None,
    rng: random.Random | None = None,
) -> float:
    """Delay before attempt `attempt + 1` (attempt counts from 1)."""
    delay = (rng or random).uniform(0, min(cap_s, base_s * 2 ** (attempt - 1)))
    return max(delay, parse_retry_after(retry_after) or 0.0)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
