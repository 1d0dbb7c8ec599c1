"""The extraction proves itself: its log-probabilities of each local answer against the engine's own.

A local engine records, while it generates, the log-probability of every id it emits
(generation rows' `output_logprobs`). The extraction computes the same numbers from its own
last state (logprobs.py). For the same weights and the same ids they agree to the numeric noise
of the compute dtype; the anchors' silent extraction failures do not: states shifted by one
position, a batch-mate's states, a prefix cache that shortened them, the last state taken one
layer early all move the answer's log-probabilities by nats, not by the noise. So every local
answer in a shard is compared, position by position, before the shard counts as extracted, and
a disagreement fails the extraction naming the samples and the first position that differs.

Comparable are the engines' reports of the model's own distribution: vLLM's (raw, its default
`--logprobs-mode`) and SGLang's at temperature 1 or greedy (SGLang reports the distribution
after temperature scaling; at another temperature the check skips the row and counts it).
Answers of a stand-in engine (the dev server's `local_engine`) carry no model's log-probabilities
and are not compared: the summary says so.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_data.errors import UserError

# The largest mean |extraction - engine| (nats per answer token) that is numeric noise, by compute
# dtype. float32: measured on vLLM's CPU engine against the extraction's own fp32 head
# (tests/engine/test_vllm_extract.py, docs/hidden_states.md "Log-probabilities"); the half dtypes
# are bounded by one rounding of logits of magnitude ~30 (2^-8 x 30 ~ 0.12 for bfloat16).
TOLERANCE = {"float32": 2e-3, "float16": 0.03, "bfloat16": 0.15}
SHOWN = 5


class ExtractionDisagrees(RuntimeError):
    """The extraction's log-probabilities of local answers differ from the engine's own."""


@dataclass(frozen=True)
class EngineAnswer:
    """What the engine said of one local answer: each output id's log-probability."""

    logprobs: tuple[float, ...]


def comparable(distribution: dict[str, Any] | None) -> bool:
    """Whether an engine's reported distribution is the model's own (what the extraction computes)."""
    if not distribution:
        return False
    if distribution.get("distribution") == "raw":
        return True
    return distribution.get("distribution") == "temperature_scaled" and float(distribution.get("temperature", 0)) == 1.0


def engine_answers(
    store, run_key: str, datasets: Iterable[str], sample_ids: set[str]
) -> tuple[dict[str, EngineAnswer], Counter[str]]:
    """The engine's log-probabilities of the local answers among `sample_ids`, from the run's local
    generation stages (only the columns needed, batch by batch), and why others are not compared."""
    from eagle3_data.stages import LOCAL
    from eagle3_data.storage import StageRef

    out: dict[str, EngineAnswer] = {}
    skipped: Counter[str] = Counter()
    for dataset in datasets:
        ref = StageRef(run_key, LOCAL, dataset)
        if not store.is_complete(ref):
            continue
        if "local_engine" in (store.read_manifest(ref).get("stand_ins") or []):
            skipped["stand_in_engine"] += sum(1 for _ in _wanted(store, ref, sample_ids))
            continue
        for row in _wanted(store, ref, sample_ids):
            if row["output_logprobs"] is None:
                skipped["not_reported"] += 1
            elif not comparable(json.loads(row["provenance"] or "{}").get("logprobs")):
                skipped["other_distribution"] += 1
            else:
                out[row["sample_id"]] = EngineAnswer(tuple(row["output_logprobs"]))
    return out, skipped


def _wanted(store, ref, sample_ids: set[str]):
    columns = ["sample_id", "status", "output_logprobs", "provenance"]
    for batch in store.iter_batches(ref, columns=columns):
        for row in batch.to_pylist():
            if row["sample_id"] in sample_ids and row["status"] == "ok":
                yield row


@dataclass
class LogprobCheck:
    """Compares, sample by sample, the extraction's log-probabilities of each local answer (its
    positions `prompt_tokens ..` of the record, as far as the record holds them) with the engine's."""

    answers: dict[str, EngineAnswer]
    tolerance: float
    skipped: Counter[str] = field(default_factory=Counter)
    compared: int = 0
    tokens: int = 0
    worst: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def for_dtype(
        cls,
        answers: dict[str, EngineAnswer],
        dtype: str,
        skipped: Counter[str] | None = None,
        tolerance: float | None = None,
    ) -> LogprobCheck:
        if tolerance is None and dtype not in TOLERANCE:
            raise UserError(
                f"no log-probability tolerance is known for compute dtype {dtype!r} (known: {', '.join(TOLERANCE)})"
            )
        return cls(answers, TOLERANCE[dtype] if tolerance is None else tolerance, skipped or Counter())

    def observe(self, sample_id: str, target: torch.Tensor, prompt_tokens: int) -> None:
        answer = self.answers.get(sample_id)
        if answer is None:
            return
        n = min(len(answer.logprobs), int(target.numel()) - prompt_tokens)
        if n <= 0:
            self.skipped["truncated_before_the_answer"] += 1
            return
        ours = target[prompt_tokens : prompt_tokens + n].double()
        theirs = torch.tensor(answer.logprobs[:n], dtype=torch.float64)
        diff = (ours - theirs).abs().nan_to_num(nan=float("inf"))  # a NaN where the engine had a number is a failure
        mean = float(diff.mean())
        self.compared += 1
        self.tokens += n
        self.worst = max(self.worst, mean)
        if mean > self.tolerance:
            first = int((diff > self.tolerance).nonzero()[0])
            self.failures.append(
                {
                    "sample_id": sample_id,
                    "mean_abs_diff": mean,
                    "answer_tokens": n,
                    "first_position": prompt_tokens + first,
                    "first_diff": float(diff[first]),
                    "extraction": float(ours[first]),
                    "engine": float(theirs[first]),
                }
            )

    def summary(self) -> dict[str, Any]:
        return {
            "compared_samples": self.compared,
            "compared_tokens": self.tokens,
            "tolerance": self.tolerance,
            "worst_mean_abs_diff": self.worst,
            "failed_samples": len(self.failures),
            "failures": self.failures[:SHOWN],
            "not_compared": dict(sorted(self.skipped.items())),
        }

    def raise_if_failed(self, where: str) -> None:
        if not self.failures:
            return
        shown = "; ".join(
            f"sample {f['sample_id']}: mean |diff| {f['mean_abs_diff']:.4g} nats over "
            f"{f['answer_tokens']} answer tokens, first at position {f['first_position']} "
            f"(extraction {f['extraction']:.4f}, engine {f['engine']:.4f})"
            for f in self.failures[:SHOWN]
        )
        raise ExtractionDisagrees(
            f"{where}: the extraction's log-probabilities of {len(self.failures)} of {self.compared} local answers "
            f"differ from the engine's own beyond the numeric noise ({self.tolerance:g} nats per token): {shown}. "
            "Its states are not the target's over these ids (shifted, another sample's, cut by a prefix cache, "
            "the wrong layer?): nothing of this shard was committed"
        )
