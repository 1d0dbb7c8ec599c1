"""The extraction's recorded params stay as the manifests already committed hold them."""

from __future__ import annotations

from eagle3_data.config import load_config
from eagle3_data.extraction_params import hidden_states_params
from eagle3_data.runs.run import Run


def _run(overrides: dict) -> Run:
    config = load_config().with_overrides({"hidden_states": overrides}) if overrides else load_config()
    return Run(config=config, run_key="k", date=None, datasets=[], dry_run=False, skip_hidden_states=False)


def test_the_default_configs_params_are_the_ones_committed_manifests_hold():
    """A committed extraction is reused only when its params compare equal (runs.reuse): these
    dicts, byte for byte, are what the extraction recorded before it took `hidden_states` itself."""
    default = {
        "convention": "output",
        "last_hidden": True,
        "token_budget": 8192,
        "model": "dev:tiny-kimi-k25",
        "backend": "transformers",
        "last_hidden_norm": "pre",
    }
    assert list(hidden_states_params(_run({})).items()) == list(default.items())  # in the recorded order too
    every_choice = {
        "layer_ids": [1, 3, 5],
        "fp8": True,
        "storage_dtype": "fp32",
        "shard_tokens": 1000,
        "last_hidden_norm": "post",
        "batch_tokens": 512,
        "convention": "input",
        "last_hidden": False,
        "max_images": 2,
        "backend": "vllm",
    }
    params = hidden_states_params(_run(every_choice))
    expected = {
        "convention": "input",
        "last_hidden": False,
        "token_budget": 512,
        "model": "dev:tiny-kimi-k25",
        "backend": "vllm",
        "max_images": 2,
        "layer_ids": [1, 3, 5],
        "use_fp8": True,
        "storage_dtype": "fp32",
        "out_shard_tokens": 1000,
    }
    assert list(params.items()) == list(expected.items())
    assert type(params["layer_ids"]) is list  # a tuple would not compare equal to the manifest's list
