"""The overflow stage's spend cap: dispatch stops before spent + what the requests in flight may
cost would pass `max_usd`.

A request's estimate is an upper bound from prices, not a ratio of whole answers: its prompt
tokens (known before it is sent) times the prompt price plus `max_new_tokens` times the
completion price. Dividing an answer's whole cost by its completion tokens (the old estimate)
priced a 30k-token trajectory prompt with a 40-token tool call at ~$0.93 a request, and the
cap then held concurrency at ~10 of 256 for nothing. Prices come from OpenRouter's model list
or the config (`openrouter_pricing`), and answers teach the rest: their cost split where the
provider gives one, else the tightest bounds their costs allow (a price is at most an answer's
cost over its tokens of that kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3_data.stages.generate.openrouter_pricing import Prices, answer_prices


class Budget:
    def __init__(
        self,
        max_usd: float | None,
        spent_usd: float = 0.0,
        *,
        max_new_tokens: int | None = None,
        prices: Prices = Prices(),
        first_estimate_usd: float = 0.01,
    ):
        self.max_usd, self.spent, self.max_new_tokens = max_usd, spent_usd, max_new_tokens
        self.prices, self.first_estimate_usd = prices, first_estimate_usd
        self.reserved = 0.0  # the estimates of the samples in flight
        self.in_flight = 0  # samples dispatched and not yet settled: their answers are not priced yet
        self._bounds = Prices()  # learned upper bounds: min over answers of cost / tokens of that kind
        self._largest_cost = 0.0
        self._longest = 0  # completion tokens of the longest answer (max_new_tokens unknown)

    def estimate(self, prompt_tokens: int) -> float:
        """What one request with `prompt_tokens` may cost at most."""
        p = self.prices.prompt if self.prices.prompt is not None else self._bounds.prompt
        c = self.prices.completion if self.prices.completion is not None else self._bounds.completion
        if p is None and c is None:
            return max(self.first_estimate_usd, self._largest_cost)
        completion = self.max_new_tokens or self._longest
        if p is None or c is None:  # one side unknown: no bound from prices alone
            return max(prompt_tokens * (p or 0.0) + completion * (c or 0.0), self._largest_cost)
        return prompt_tokens * p + completion * c

    def allows(self, estimate: float) -> bool:
        return self.max_usd is None or self.spent + self.reserved + estimate <= self.max_usd

    def exhausted(self, estimate: float) -> bool:
        """A request `allows` refuses will not fit once the samples in flight are priced either:
        none is in flight, or what is spent already leaves no room for it."""
        return self.in_flight == 0 or self.spent + estimate > (self.max_usd or 0.0)

    def reserve(self, estimate: float) -> None:
        """A sample dispatched: its estimate is held until it is settled (`release`)."""
        self.reserved += estimate
        self.in_flight += 1

    def release(self, estimate: float) -> None:
        self.reserved = max(0.0, self.reserved - estimate)
        self.in_flight -= 1

    def add(self, cost: float, usage: Mapping[str, Any] | None = None) -> None:
        """Count `cost` as spent and learn prices from the answer's `usage` (None: a cost without an
        answer, e.g. a cut stream priced from OpenRouter's record)."""
        self.spent += cost
        if cost <= 0 or not usage:
            return
        self._largest_cost = max(self._largest_cost, cost)
        self._longest = max(self._longest, usage.get("completion_tokens") or 0)
        self.prices = self.prices.at_least(answer_prices(usage))
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        bound = Prices(cost / prompt if prompt else None, cost / completion if completion else None)
        self._bounds = Prices(
            *(
                b if a is None else a if b is None else min(a, b)
                for a, b in ((self._bounds.prompt, bound.prompt), (self._bounds.completion, bound.completion))
            )
        )
