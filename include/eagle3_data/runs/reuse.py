"""The one reuse rule: a stage whose manifest is complete, made from the same input manifests,
params and tokenizer, is reused, not recomputed; one made from anything else is refused, never
overwritten. Committed means immutable.

That is what makes reruns and backfills idempotent (unchanged stages keep their bytes) and what
keeps a mistaken rerun from destroying work: reusing a run key with another prompt file, another
config or another tokenizer stops before its first write, naming what differs. Replacing a stage
is a named action: the run's `fresh` stages (`--fresh STAGE` on the stage commands, the DAG's
`fresh_stages` param). It discards the stage and the downstream stages built on it, which must
be named too, and moves paid answers to the archive first (storage/archive.py), from which the
next run of that stage takes back every answer that still matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from eagle3_data.canonical import canonical_json
from eagle3_data.errors import StageConflict
from eagle3_data.stages import FRESH_STAGES
from eagle3_data.storage.archive import PAID_STAGES, discard_stages

if TYPE_CHECKING:
    from eagle3_data.runs.run import Run


def reusable(store, ref, inputs: list[Any], params: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The committed manifest of `ref` if it was made from these inputs (and `params`, unless
    None); else None. Changes nothing: a predicate (publish asks it of stages it only reports)."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    if _differences(store, manifest, inputs, params, {}):
        return None
    trusted(store, ref, manifest)
    return manifest


def settle(
    run: Run,
    store,
    ref,
    inputs: list[Any],
    params: dict[str, Any] | None,
    *,
    what: str,
    hashes: Mapping[str, str | None] | None = None,
    compare: Callable[[dict[str, Any]], list[str]] | None = None,
) -> dict[str, Any] | None:
    """Where every stage decides, before its first write, what to do with `ref`:
    - complete from these inputs, `params` (None: not compared) and tokenizer `hashes`: its
      manifest, re-checked (`trusted`): the stage is reused (`compare`: more differences the
      caller reads from the manifest, as phrases);
    - complete from anything else: a `StageConflict` naming each difference and the way out,
      unless the run names the stage in `fresh`: then it is replaced (`replace`) and None returned;
    - not complete: None (the writer resumes an unfinished attempt, or refuses one made from
      other params: storage/writer.py)."""
    if not store.is_complete(ref):
        return None
    manifest = store.read_manifest(ref)
    differ = _differences(store, manifest, inputs, params, hashes or {}) + (compare(manifest) if compare else [])
    if not differ:
        trusted(store, ref, manifest)
        return manifest
    if ref.stage in run.fresh:
        replace(run, store, ref, f"{what}: replaced by --fresh ({'; '.join(differ)})")
        return None
    uri = store.uri(ref)
    downstream = store.downstream(ref)
    named = [ref.stage, *dict.fromkeys(d.stage for d in downstream if d.stage != ref.stage)]
    archived = (
        "; its paid answers are archived first and reused wherever they still match"
        if ref.stage in PAID_STAGES or any(d.stage in PAID_STAGES for d in downstream)
        else ""
    )
    below = f" and the {len(downstream)} stages built on it ({', '.join(store.uri(d) for d in downstream)})"
    raise StageConflict(
        f"{what}: {uri} is committed from other inputs than this run's: {'; '.join(differ)}. A committed "
        f"stage is never overwritten. Rerun with what made it (it is reused), use another run key, or replace "
        f"it{below if downstream else ''} with {fresh_flags(named)} (DAG param fresh_stages: {named}){archived}"
    )


def replace(run: Run, store, ref, reason: str) -> None:
    """Discard `ref` and every complete stage built on it, generation stages archived first; refused
    (nothing touched) while one of those is not named in the run's `fresh`, or while a writer holds
    any of their leases (StageBusy)."""
    discard_stages(store, [ref, *_named_downstream(run, store, ref, "cannot be replaced alone")], reason)


def reopen(run: Run, store, ref, reason: str) -> None:
    """Before a complete stage is reopened (`--rerun`): its new manifest will be another commit, so
    the complete stages built on it are discarded first (refused unless the run names them)."""
    if store.is_complete(ref):
        discard_stages(store, _named_downstream(run, store, ref, "cannot be reopened"), reason)


def _named_downstream(run: Run, store, ref, verb: str) -> list[Any]:
    """The complete stages built on `ref`; a StageConflict naming the flags when one of them is not
    in the run's `fresh`."""
    downstream = store.downstream(ref)
    if unnamed := [d for d in downstream if d.stage not in run.fresh]:
        stages = list(dict.fromkeys([ref.stage, *(d.stage for d in downstream)]))
        raise StageConflict(
            f"{store.uri(ref)} {verb}: {len(unnamed)} committed stages were built on it "
            f"({', '.join(store.uri(d) for d in unnamed)}); name them too: {fresh_flags(stages)} "
            f"(DAG param fresh_stages: {stages})"
        )
    return downstream


def fresh_flags(stages: list[str]) -> str:
    """The CLI spelling of a replacement of `stages`."""
    return " ".join(f"--fresh {s}" for s in stages)


def check_fresh(stages: list[str], where: str) -> frozenset[str]:
    """The stage names of a `--fresh`/`fresh_stages`, each one a stage a run can replace."""
    from eagle3_data.errors import UserError

    bad = [s for s in stages if s not in FRESH_STAGES]
    if bad:
        raise UserError(f"{where}: {', '.join(map(repr, bad))} is not a stage; stages: {', '.join(FRESH_STAGES)}")
    return frozenset(stages)


def _short(value: Any) -> str:
    text = canonical_json(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _differences(
    store, manifest: dict[str, Any], inputs: list[Any], params: dict[str, Any] | None, hashes: Mapping[str, str | None]
) -> list[str]:
    """What separates the committed `manifest` from this run's inputs, params and hashes, one
    phrase each (empty: the same)."""
    out = []
    have = [i.get("manifest_sha256") for i in manifest.get("inputs", [])]
    records = [store.input_record(i) for i in inputs]
    if [r["manifest_sha256"] for r in records] != have:
        names = [r["uri"] for r in records] or ["none"]
        out.append(f"its inputs were other commits than {', '.join(names)} now")
    if params is not None:
        committed = manifest.get("params") or {}
        for key in sorted(set(committed) | set(params)):
            if canonical_json(committed.get(key)) != canonical_json(params.get(key)):
                out.append(f"{key} {_short(committed.get(key))} (committed) vs {_short(params.get(key))} (this run)")
    for name, value in hashes.items():
        if value is not None and manifest.get(name) != value:
            out.append(f"{name} {str(manifest.get(name))[:12]} (committed) vs {value[:12]} (this run)")
    return out


def trusted(store, ref, manifest: dict[str, Any]) -> None:
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
