"""What decides the extracted bytes, as the extraction's manifest records it (`hidden_states_params`).

The extraction takes the config's `hidden_states` section itself (`HiddenStatesConfig`); the
extraction, the probe, publish and the plan all locate or size the same extraction by these
params, so they sit below the stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3_data.runs.run import Run


def hidden_states_params(run: Run) -> dict[str, Any]:
    """What decides the extracted bytes (recorded in the manifest; the model as configured, not
    where a dev build happens to be cached): every extraction choice of the config, so changing
    any of them re-extracts. The CLI's `extract` builds the same params from the same config.

    The keys are the names the first manifests recorded them under (`token_budget` for
    `batch_tokens`, `use_fp8` for `fp8`, `out_shard_tokens` for `shard_tokens`): a manifest is
    reused only when its params compare equal, so they stay as written."""
    h = run.config.hidden_states
    params: dict[str, Any] = {
        "convention": h.convention,
        "last_hidden": h.last_hidden,
        "token_budget": h.batch_tokens,
        "model": run.config.model.source,
        "backend": h.backend,
    }
    if h.max_images:  # image samples extracted instead of left out (absent when 0: earlier manifests stay reusable)
        params["max_images"] = h.max_images
    later = {
        "layer_ids": list(h.layer_ids) if h.layer_ids else None,
        "use_fp8": h.fp8,
        "storage_dtype": h.storage_dtype,
        "out_shard_tokens": h.shard_tokens,
        "last_hidden_norm": h.last_hidden_norm,
    }
    params.update({k: value for k, value in later.items() if value != _LATER_CHOICES[k]})
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
