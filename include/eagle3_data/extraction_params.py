"""What decides the extracted bytes: the hidden-states choices of the config, as the extraction
takes them (`ExtractOptions`) and as its manifest records them (`hidden_states_params`).

The extraction, the probe, publish and the plan all locate or size the same extraction, so the
params sit below the stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_data.runs.run import Run

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtractOptions:
    """What decides the extracted bytes (`hidden_states` of the config: `from_config`)."""

    convention: str = "output"
    layer_ids: list[int] | None = None  # None: EAGLE-3 defaults for the convention
    last_hidden: bool = True
    last_hidden_norm: str = "pre"  # pre: before the final norm (speculators; SpecForge's export normalises); post
    token_budget: int = 16_384  # padded tokens per forward
    out_shard_tokens: int = 65_536  # tokens per output file
    use_fp8: bool = False
    storage_dtype: str = "bf16"  # bf16 | fp32 | compute (see shards.resolve_storage_dtype)
    logprobs: bool = True  # every token's log-probability under the target, stored with the states (logprobs.py)

    @classmethod
    def from_config(cls, h) -> ExtractOptions:
        """From a `HiddenStatesConfig`."""
        return cls(
            convention=h.convention,
            layer_ids=list(h.layer_ids) if h.layer_ids else None,
            last_hidden=h.last_hidden,
            last_hidden_norm=h.last_hidden_norm,
            token_budget=h.batch_tokens,
            out_shard_tokens=h.shard_tokens,
            use_fp8=h.fp8,
            storage_dtype=h.storage_dtype,
            logprobs=h.logprobs,
        )


def hidden_states_params(run: Run) -> dict:
    """What decides the extracted bytes (recorded in the manifest; the model as configured, not
    where a dev build happens to be cached): every extraction choice of the config, so changing
    any of them re-extracts. The CLI's `extract` builds the same params from the same config."""
    h, o = run.config.hidden_states, extract_options(run)
    params = {
        "convention": o.convention,
        "last_hidden": o.last_hidden,
        "token_budget": o.token_budget,
        "model": run.config.model.source,
        "backend": h.backend,
    }
    if h.max_images:  # image samples extracted instead of left out (absent when 0: earlier manifests stay reusable)
        params["max_images"] = h.max_images
    params.update({k: getattr(o, k) for k, default in _LATER_CHOICES.items() if getattr(o, k) != default})
    return params


# Choices added after the first extraction stages were committed: recorded only away from the value
# those stages were extracted with, so a stage extracted before they existed is still reused.
_LATER_CHOICES = {
    "layer_ids": None,
    "use_fp8": False,
    "storage_dtype": "bf16",
    "out_shard_tokens": 65_536,
    "last_hidden_norm": "post",
}


def extract_options(run: Run):

    return ExtractOptions.from_config(run.config.hidden_states)
