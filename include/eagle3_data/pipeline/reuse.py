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


def reusable(
    store, ref, inputs: list, params: dict | None = None, *, invalidate: bool = False
) -> dict[str, Any] | None:
    """The committed manifest of `ref` if it was made from these inputs (and `params`, unless
    None); else None, after invalidating the stale manifest when `invalidate` (generation: the
    writer then resumes by sample id and refuses to mix, never discarding paid rows)."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    want = [store.input_record(i)["manifest_sha256"] for i in inputs]
    have = [i.get("manifest_sha256") for i in manifest.get("inputs", [])]
    if want == have and (params is None or same_params(manifest, params)):
        trusted(store, ref, manifest)
        return manifest
    if invalidate:
        store.invalidate(ref)
    return None


def trusted(store, ref, manifest: dict) -> None:
    """A complete stage about to be reused is re-checked cheaply first (`store.quick_check`: one
    listing, sizes and Last-Modified against the manifest), so a part deleted, truncated or
    rewritten after the commit is named here, before any downstream stage trusts it, instead of
    surfacing as a hash mismatch deep inside a later stage (or never, for a stage only reported)."""
    from eagle3_data.storage import CorruptArtifact

    if problems := store.quick_check(ref, manifest):
        uri = store.uri(ref)
        raise CorruptArtifact(
            f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}: the complete stage {uri} "
            f"changed after its commit, so it is not reused. See `eagle3-data stage verify {uri}`; then "
            f"`eagle3-data stage discard {uri}` and rerun (generation replays its journal first)"
        )
