"""The overflow stage's journal of attempts: what may be paid is counted, never paid twice.

Each request is journaled when the provider names it (`opened`) and closed when its answer
needs no pricing (`closed`); one that may be billed without an answer (a cut stream, an errored
one without a cost, an unreadable body, a timed-out request, one in flight when an earlier
process died) is priced (`lose`: OpenRouter's record of its generation, else the budget's
estimate, an upper bound), journaled settled and kept for its sample's row. The records of those
priced at the estimate are looked up again before the manifest (`reprice_estimates`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from eagle3_data.stages.generate.checkpoint import StageRun
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_http import SdkPost
from eagle3_data.stages.generate.openrouter_rows import SOURCE
from eagle3_data.stages.generate.progress import ProgressSink

log = logging.getLogger(__name__)


class AttemptLedger:
    def __init__(
        self,
        stage: StageRun,
        budget: Budget,
        progress: ProgressSink,
        *,
        cost_lookups: int,
        cost_lookup_delay_s: float,
    ):
        self.stage, self.budget, self.progress = stage, budget, progress
        self.cost_lookups, self.cost_lookup_delay_s = cost_lookups, cost_lookup_delay_s
        # sample id -> its priced attempts without an answer, not yet in a row
        self.lost: dict[str, list[dict[str, Any]]] = {sid: list(a) for sid, a in stage.lost_attempts.items()}
        # every priced attempt without an answer this process knows (an earlier process's too): the
        # ones at the estimate are looked up again at the end (`reprice_estimates`)
        self.settled: list[dict[str, Any]] = [a for attempts in stage.lost_attempts.values() for a in attempts]
        self._earlier = {a.get("attempt") for a in self.settled}
        self.repriced: list[dict[str, Any]] = []

    def opened(self, attempt_id: str, sample_id: str, generation_id: str | None, prompt_tokens: int) -> None:
        self.stage.journal_attempt(
            {
                "attempt": attempt_id,
                "sample_id": sample_id,
                "state": "open",
                "generation_id": generation_id,
                "prompt_tokens": prompt_tokens,
            }
        )

    def closed(self, attempt_id: str, sample_id: str) -> None:
        """Its answer's cost says nothing was billed, or there is no generation to look up."""
        self.stage.journal_attempt({"attempt": attempt_id, "sample_id": sample_id, "state": "closed"})

    def take_lost(self, sample_id: str) -> list[dict[str, Any]]:
        """The attempts `sample_id` lost, for the row that settles it (paid money it accounts for)."""
        return self.lost.pop(sample_id, [])

    async def lose(
        self,
        client: SdkPost,
        sample_id: str,
        prompt_tokens: int,
        attempt: str | None,
        generation_id: str | None,
        why: str,
    ) -> None:
        """Count a request that may be billed without an answer: priced from OpenRouter's record of
        its generation, else at the budget's estimate for it (an upper bound), journaled settled
        and kept for the sample's row."""
        cost = None
        if generation_id is not None:
            cost = await client.generation_cost(generation_id, self.cost_lookups, self.cost_lookup_delay_s)
        source = "generation_lookup" if cost is not None else "estimate"
        if cost is None:
            cost = self.budget.estimate(prompt_tokens)
        record = {
            "attempt": attempt,
            "sample_id": sample_id,
            "generation_id": generation_id,
            "prompt_tokens": prompt_tokens,
            "state": "settled",
            "cost_usd": cost,
            "cost_source": source,
            "why": why,
        }
        self.stage.journal_attempt(record)
        self.budget.add(cost)
        self.progress.update(cost_usd=cost)
        self.lost.setdefault(sample_id, []).append(record)
        self.settled.append(record)
        log.warning("%s: sample %s: %s; counted $%.6f (%s)", SOURCE, sample_id, why, cost, source)

    async def price_unsettled(self, client: SdkPost) -> None:
        """Price the requests an earlier process opened and never settled (it died with them in
        flight), before their samples are asked again: all at once (each record lookup may wait
        for OpenRouter's record to appear; up to `concurrency` were in flight)."""
        await asyncio.gather(
            *(
                self.lose(
                    client,
                    a["sample_id"],
                    a.get("prompt_tokens") or 0,
                    a.get("attempt"),
                    a.get("generation_id"),
                    "in flight when an earlier attempt of the stage ended",
                )
                for a in self.stage.unsettled_attempts
            )
        )
        self.stage.unsettled_attempts.clear()

    def at_estimate(self) -> list[dict[str, Any]]:
        """The attempts priced at the estimate whose generation was named: a record may yet come."""
        return [a for a in self.settled if a.get("cost_source") == "estimate" and a.get("generation_id")]

    async def reprice_estimates(self, client: SdkPost, record_wait_s: float) -> None:
        """Look up again the records of the attempts priced at the estimate (`at_estimate`):
        OpenRouter's record usually lands seconds later. All of them each round, waiting
        `cost_lookup_delay_s`, then twice as long (at most 5 s), until `record_wait_s` has passed;
        each one found replaces its estimate (journaled, in the budget and the stage's cost). One
        still missing stays at the estimate: never below."""
        todo = self.at_estimate()
        deadline, delay = time.monotonic() + record_wait_s, max(self.cost_lookup_delay_s, 0.01)
        while todo:
            costs = await asyncio.gather(*(client.generation_cost(a["generation_id"], 1, 0.0) for a in todo))
            for a, cost in zip(todo, costs):
                if cost is not None:
                    self._reprice(a, cost)
            todo = [a for a, cost in zip(todo, costs) if cost is None]
            left = deadline - time.monotonic()
            if not todo or left <= 0 or not client.records:
                break
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, 5.0)
        if todo:
            log.warning(
                "%s: %d attempts still have no record at /generation after %g s: counted at the estimate "
                "(an upper bound)",
                SOURCE,
                len(todo),
                record_wait_s,
            )

    def _reprice(self, attempt: dict[str, Any], cost: float) -> None:
        estimate = attempt.get("cost_usd") or 0.0
        delta = self.stage.reprice_attempt(attempt, cost, earlier=attempt.get("attempt") in self._earlier)
        self.budget.add(delta)
        self.repriced.append(
            {
                "attempt": attempt.get("attempt"),
                "sample_id": attempt.get("sample_id"),
                "generation_id": attempt.get("generation_id"),
                "estimate_usd": round(estimate, 10),
                "cost_usd": cost,
            }
        )
        log.info(
            "%s: sample %s: the record of generation %s came: $%.6f instead of the estimate $%.6f",
            SOURCE,
            attempt.get("sample_id"),
            attempt.get("generation_id"),
            cost,
            estimate,
        )

    def priced_summary(self) -> dict[str, Any]:
        """For the manifest: how the attempts without an answer were priced, by OpenRouter's record
        of their generation or at the budget's estimate (an upper bound), and those an end-of-stage
        lookup priced again (their rows' provenance still says the estimate: the manifest's
        `spent_total_usd` and the summary's `cost_usd` hold the record's price)."""
        sources = [a.get("cost_source") for a in self.settled]
        return {
            "by_record": sources.count("generation_lookup"),
            "by_estimate": sources.count("estimate"),
            "repriced": self.repriced,
        }
