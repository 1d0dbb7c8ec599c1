"""The one reuse rule: a stage whose manifest is complete, made from the same input manifests
(and the same params, where the stage's params decide its output), is reused, not recomputed.

That is what makes reruns and backfills idempotent: unchanged stages keep their bytes, and a stage
that must recompute invalidates its old manifest, which its downstream stages notice through
their inputs.
"""

from __future__ import annotations

from typing import Any

from eagle3_data.canonical import canonical_json


def same_params(manifest: dict, params: dict) -> bool:
    return canonical_json(manifest.get("params")) == canonical_json(params)


def reusable(store, ref, inputs: list, params: dict | None = None, *, invalidate: bool = False) -> dict[str, Any] | None:
    """The committed manifest of `ref` if it was made from these inputs (and `params`, unless
    None); else None, after invalidating the stale manifest when `invalidate` (generation: the
    writer then resumes by sample id and refuses to mix, never discarding paid rows)."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    want = [store.input_record(i)["manifest_sha256"] for i in inputs]
    have = [i.get("manifest_sha256") for i in manifest.get("inputs", [])]
    if want == have and (params is None or same_params(manifest, params)):
        return manifest
    if invalidate:
        store.invalidate(ref)
    return None
