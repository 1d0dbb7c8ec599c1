"""The overflow stage's rows: each sample's result settled into the journal, priced and counted.

An answer's row is journaled paid (final whatever it is: never paid again); a failure the circuit
breaker counts is held until the run of identical errors is broken or trips it
(`openrouter_breaker`). The answered count and latency feed the manifest's timing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from eagle3_data.stages.generate.checkpoint import StageRun
from eagle3_data.stages.generate.contracts import StopReason
from eagle3_data.stages.generate.openrouter_breaker import Breaker
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_outcomes import Answer, DispatchStop, Failed, Prepared, ReadyPrompt
from eagle3_data.stages.generate.openrouter_rows import RowContext, answer_row
from eagle3_data.stages.generate.progress import ProgressSink


class Settler:
    def __init__(
        self,
        stage: StageRun,
        budget: Budget,
        breaker: Breaker[Failed],
        progress: ProgressSink,
        stop: DispatchStop,
        rows: RowContext,
    ):
        self.stage, self.budget, self.breaker, self.progress, self.stop = stage, budget, breaker, progress, stop
        self.rows = rows  # what every row records (its pin once read)
        self.latency_sum, self.answered, self.started = 0.0, 0, time.monotonic()

    def settle(self, prepared: Prepared, result: Answer | Failed, latency_s: float) -> None:
        if isinstance(result, Failed):
            if result.breaker is not None:
                if self.breaker.tripped is None:  # after a trip it stays pending, whatever else comes back
                    self.journal_failures(self.breaker.hold(result.breaker, result))
                return
            self.journal_failures(self.breaker.release())
            self.journal_failures([result])
            return
        assert isinstance(prepared, ReadyPrompt)  # an answer comes only for a prompt that was sent
        self.journal_failures(self.breaker.release())
        prompt = prepared.prompt
        if result.cost is None and self.budget.max_usd is not None:
            self.stop.stop(
                StopReason.UNPRICED,
                f"sample {prompt.sample_id}: no usage.cost, no record at /generation and "
                "generation.overflow.price_usd_per_mtok is not set: the budget cannot bind (the answer is kept)",
            )
        row = answer_row(
            prompt, prepared.prompt_ids, result.data, result.cost, result.cost_source, self.rows, result.lost
        )
        ok = row["status"] == "ok"
        if ok:
            self.latency_sum += latency_s
            self.answered += 1
        usage: Mapping[str, Any] = row["usage"] or {}
        cost = usage.get("cost_usd") or 0.0
        self.budget.add(cost, {**(result.data.get("usage") or {}), "cost": cost})
        self.stage.journal(row, permanent=True, paid=True)  # paid: final whatever it is, never paid again
        self.progress.update(ok=int(ok), failed=int(not ok), cost_usd=cost, tokens=usage.get("completion_tokens") or 0)

    def release_held(self) -> None:
        """At the pass's end: fewer than K identical failures held, so they are the prompts' own."""
        self.journal_failures(self.breaker.release())

    def journal_failures(self, failures: list[Failed]) -> None:
        for failed in failures:
            self.stage.journal(failed.row, permanent=failed.permanent)
            self.progress.update(failed=1)

    def timing(self, concurrency: int) -> dict[str, Any]:
        """For the manifest (and the next run's `balanced` routing): the concurrency and the mean
        seconds per answered sample of this attempt (retries and their backoff included)."""
        return {
            "concurrency": concurrency,
            "answered": self.answered,
            "wall_s": round(time.monotonic() - self.started, 3),
            "latency_s_mean": round(self.latency_sum / self.answered, 4) if self.answered else None,
        }
