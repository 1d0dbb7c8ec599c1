"""How long each DAG task may run before Airflow kills it (`execution_timeout`): the config's
per-stage values (`timeouts:`), and for the generation tasks a bound sized from the run.

A generation task runs as long as its samples take: the same measured rates that route a
`balanced` run (`route.rate_inputs`: the newest committed generation of the dataset in another
run, else the config's latencies) give its expected seconds; it may take `generation_margin`
times that, never less than the floor (a small dataset on a slow start) nor more than the cap.
A task killed at its bound is retried; the retry resumes from what the first attempt committed.
Rows asked for turn by turn (`every_turn` on the regenerated history, `trajectory`) count as
their user turns, times `max_trajectory_steps` answers each in a trajectory: the most they can take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_data.runs.run import Run
from eagle3_data.stages import LOCAL, OVERFLOW

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

ROUTES = {LOCAL: ("local", "both"), OVERFLOW: ("overflow", "both")}


def generation_timeout(
    run: Run, store: ArtifactStore, dataset: str, stage: str, routed_counts: dict[str, int]
) -> tuple[float, str]:
    """(seconds, how they were sized) for `stage` (generate_local | generate_overflow) of `dataset`."""
    from eagle3_data.runs.upstream import rate_inputs, rates

    t = run.config.timeouts
    samples = sum(int(routed_counts.get(route, 0)) for route in ROUTES[stage])
    g, per_row = run.config.generation, ""
    if routed_counts.get("user_turns") and routed_counts.get("prompts"):  # a row's turns are asked for in rounds
        steps = g.max_trajectory_steps if g.regenerate == "trajectory" else 1
        turns_per_row = routed_counts["user_turns"] / routed_counts["prompts"]
        samples = round(samples * turns_per_row * steps)
        per_row = f" (turns: {turns_per_row:.3g} user turns a row x {steps} answers each at most)"
    inputs = rate_inputs(run, store, dataset)
    side = "local" if stage == LOCAL else "overflow"
    rate = getattr(rates(inputs), side)  # samples per second
    expected = samples / rate if rate > 0 else float("inf")
    seconds = min(t.generation_cap_s, max(t.generation_floor_s, t.generation_margin * expected))
    how = (
        f"{samples} samples{per_row} at {rate:.3g} samples/s (rates from {inputs[side]['source']}): expected "
        f"{expected:.0f} s x {t.generation_margin:g}, floor {t.generation_floor_s:g} s, cap {t.generation_cap_s:g} s"
    )
    return seconds, how
