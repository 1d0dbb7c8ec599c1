"""What an overflow answer costs, and the per-token prices the budget estimates requests with.

OpenRouter bills prompt and completion tokens at separate prices. Its model list says them
(`GET /models`: `pricing.prompt`, `pricing.completion`, USD per token, as strings); the config may
set them (`generation.overflow.price_usd_per_mtok`, USD per million); answers carry their cost
(`usage.cost`) and, from some providers, its split (`usage.cost_details.upstream_inference_prompt_cost`
and `..._completions_cost`). An answer's own cost comes first from the answer, then from OpenRouter's
record of the generation, then from the prices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3_data.stages.generate.openrouter_http import SdkPost


@dataclass(frozen=True)
class Prices:
    """USD per token; None where unknown."""

    prompt: float | None = None
    completion: float | None = None

    @classmethod
    def per_mtok(cls, prices: Mapping[str, float] | None) -> Prices:
        """The config's `price_usd_per_mtok` (0 or absent: unknown)."""
        prices = prices or {}
        return cls(*((prices.get(k) or 0.0) / 1e6 or None for k in ("prompt", "completion")))

    def known(self) -> bool:
        return self.prompt is not None or self.completion is not None

    def at_least(self, other: Prices) -> Prices:
        """Each price the larger of the two known ones: the budget's estimate stays an upper bound."""

        def top(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else max(a, b)

        return Prices(top(self.prompt, other.prompt), top(self.completion, other.completion))


def listed_prices(model: str, listed: Iterable[Mapping[str, Any]]) -> Prices:
    """The prices OpenRouter's model list gives `model` (its `id` or `canonical_slug`)."""
    for card in listed:
        if model in (card.get("id"), card.get("canonical_slug")) and isinstance(card.get("pricing"), Mapping):
            return Prices(_number(card["pricing"].get("prompt")), _number(card["pricing"].get("completion")))
    return Prices()


def answer_prices(usage: Mapping[str, Any]) -> Prices:
    """Per-token prices an answer's cost split gives (`usage.cost_details`), where it has one."""
    split = usage.get("cost_details")
    details: Mapping[str, Any] = split if isinstance(split, Mapping) else {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    p = _number(details.get("upstream_inference_prompt_cost"))
    c = _number(details.get("upstream_inference_completions_cost"))
    return Prices(
        p / prompt if p is not None and prompt else None, c / completion if c is not None and completion else None
    )


def price_answer(usage: Mapping[str, Any], prices: Prices) -> float | None:
    """USD of one answer: OpenRouter's `usage.cost`, else the prices times the reported tokens;
    None when neither is known (the budget could not bind)."""
    if usage.get("cost") is not None:
        return float(usage["cost"])
    if not prices.known() or usage.get("prompt_tokens") is None or usage.get("completion_tokens") is None:
        return None
    return float(
        usage["prompt_tokens"] * (prices.prompt or 0.0) + usage["completion_tokens"] * (prices.completion or 0.0)
    )


async def priced(
    client: SdkPost, data: Mapping[str, Any], prices: Prices, lookups: int, delay_s: float
) -> tuple[float | None, str | None]:
    """An answer's USD and where it came from: `usage.cost` ("openrouter"), else OpenRouter's
    record of the generation (`GET /generation?id=`, retried while it is not there yet:
    "generation_lookup"), else the prices ("configured_price"); (None, None) when none is known."""
    reported = data.get("usage")
    usage: Mapping[str, Any] = reported if isinstance(reported, Mapping) else {}
    if usage.get("cost") is not None:
        return float(usage["cost"]), "openrouter"
    if (
        isinstance(data.get("id"), str)
        and (cost := await client.generation_cost(data["id"], lookups, delay_s)) is not None
    ):
        return cost, "generation_lookup"
    cost = price_answer(usage, prices)
    return cost, "configured_price" if cost is not None else None


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number >= 0 else None
