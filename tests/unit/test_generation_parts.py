"""The overflow stage's parts on their own: a refused prompt is a typed value, not a stored
exception, and the budget counts the samples it holds estimates for."""

from __future__ import annotations

import asyncio
from typing import cast

from eagle3_data.chat_format.base import OutputFormat
from eagle3_data.stages.generate.checkpoint import parse_prompts
from eagle3_data.stages.generate.openrouter_attempts import AttemptLedger
from eagle3_data.stages.generate.openrouter_breaker import Breaker
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_http import SdkPost
from eagle3_data.stages.generate.openrouter_outcomes import DispatchStop, Failed, ReadyPrompt, RefusedPrompt
from eagle3_data.stages.generate.openrouter_pricing import Prices
from eagle3_data.stages.generate.openrouter_prompts import PromptFeed
from eagle3_data.stages.generate.openrouter_rows import RequestShape
from eagle3_data.stages.generate.openrouter_send import Sender


class _Format:
    """Renders "hi" and refuses anything else, as a chat template refuses a conversation."""

    def generation_prompt_ids(self, messages, tools, images):
        if messages[0]["content"] != "hi":
            raise ValueError("the template refuses this conversation")
        return [1, 2, 3]


def _prompts(*texts: str):
    rows = [{"sample_id": f"s{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    return list(parse_prompts(rows, "d", None))


def test_a_refused_prompt_is_a_typed_value_and_a_permanent_failed_row_without_a_request():
    # the stand-in has only what the feed calls (its render)
    feed = PromptFeed(cast(OutputFormat, _Format()), RequestShape("m", {}, {}, {}, False), lookahead=4)
    feed.open(_prompts("hi", "no"))
    ready, refused = feed.take(), feed.take()
    assert isinstance(ready, ReadyPrompt) and ready.prompt_ids == [1, 2, 3] and b'"model": "m"' in ready.body
    assert isinstance(refused, RefusedPrompt) and refused.reason == "the template refuses this conversation"
    assert refused.estimate == 0.0 and feed.take() is None

    sender = Sender(
        stream=False,
        concurrency=1,
        max_attempts=1,
        prices=Prices(),
        cost_lookups=0,
        cost_lookup_delay_s=0.0,
        stop=DispatchStop(),
        ledger=cast(AttemptLedger, None),  # a refused prompt is never priced
        breaker=Breaker(3, lambda error, run: None),
    )
    failed = asyncio.run(sender.sample(cast(SdkPost, None), refused, None))  # no client: it is never sent
    assert isinstance(failed, Failed) and failed.permanent and failed.breaker is None
    assert failed.row["error"] == "chat template: the template refuses this conversation"
    assert failed.row["prompt_ids"] is None and failed.row["status"] == "failed"


def test_the_budget_counts_the_samples_it_holds_estimates_for():
    budget = Budget(1.0, spent_usd=0.9)
    assert budget.exhausted(0.5)  # none in flight: nothing settling can make room
    budget.reserve(0.05)
    assert budget.in_flight == 1 and not budget.exhausted(0.05) and budget.exhausted(0.2)
    budget.release(0.05)
    assert budget.in_flight == 0 and budget.reserved == 0.0
