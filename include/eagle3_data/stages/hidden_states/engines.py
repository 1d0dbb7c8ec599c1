"""Which backend a worker process extracts with: one engine per process and settings, kept
across its shards (loading a target, or starting an engine, costs minutes on a real node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_data.errors import UserError
from eagle3_data.stages.hidden_states.backends import HiddenStateBackend, TransformersBackend

BACKENDS = ("transformers", "vllm")
_SHARED: dict[tuple[Any, ...], HiddenStateBackend] = {}


def shared_backend(
    name: str,
    model_dir: str | Path,
    *,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    max_images: int = 0,
) -> HiddenStateBackend:
    """The process's backend for these settings, created on first use and kept.

    Loading a target (or starting an engine) costs minutes on a real node; every shard a worker
    process extracts reuses the same one.
    """
    if name not in BACKENDS:
        raise UserError(f"hidden-state backend {name!r}: expected one of {', '.join(BACKENDS)}")
    key = (name, str(Path(model_dir).resolve()), tensor_parallel_size, max_model_len, max_images)
    if key not in _SHARED:
        if name == "vllm":
            from eagle3_data.stages.hidden_states.vllm_backend import VllmBackend  # its venv, started on demand

            kwargs = {"max_model_len": max_model_len} if max_model_len else {}
            _SHARED[key] = VllmBackend(
                model_dir, tensor_parallel_size=tensor_parallel_size, max_images=max_images, **kwargs
            )
        else:
            _SHARED[key] = TransformersBackend(model_dir, max_images=max_images)
    return _SHARED[key]
