"""`eagle3-data stage verify|discard URI`: check a committed stage, or remove one on purpose.

`verify` downloads every part and file of the manifest, checks sizes, sha256 and each part's
columns against the manifest's schema version: exit 0 when sound, 2 naming every bad part.
`discard` takes the stage's lease (so no writer is running), removes the stage, manifest first,
and names the downstream stages whose manifests list it as an input: they now point at data that
no longer exists (`--cascade` discards them too). A generation stage's paid answers are archived
first (storage/archive.py): a later run of the stage takes back those that still match.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_data.cli.runs import add_store_args, open_store, parse_stage_uri


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("stage", help="verify or discard a committed stage in S3")
    sub = p.add_subparsers(dest="stage_command", required=True)
    v = sub.add_parser("verify", help="check every part and file of a stage against its manifest")
    v.add_argument("uri", help="s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET")
    add_store_args(v)
    v.set_defaults(func=_verify)
    d = sub.add_parser("discard", help="remove a stage (manifest first) and name what it invalidates")
    d.add_argument("uri", help="s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET")
    d.add_argument("--cascade", action="store_true", help="also discard the downstream stages that list it as input")
    add_store_args(d)
    d.set_defaults(func=_discard)


def _verify(args: argparse.Namespace) -> int:
    from eagle3_data.storage import CorruptArtifact

    bucket, prefix, ref = parse_stage_uri(args.uri)
    store = open_store(args, bucket, prefix)
    store.check_bucket()
    manifest = store.read_manifest(ref)
    problems = store.check(ref)
    for line in problems:
        print(f"BAD  {line}", file=sys.stderr)
    n = len(manifest.get("parts", [])) + len(manifest.get("files", []))
    if problems:
        more = f" (and {len(problems) - 1} more, listed above)" if len(problems) > 1 else ""
        raise CorruptArtifact(
            f"{problems[0]}{more}: {len(problems)} of {n} objects bad; "
            f"`eagle3-data stage discard {store.uri(ref)}` and rerun the stage, or for a generation "
            f"stage `eagle3-data generate ... --rerun` (keeps the sound parts)"
        )
    print(
        f"OK   {store.uri(ref)}: {len(manifest.get('parts', []))} parts, {len(manifest.get('files', []))} files, "
        f"{manifest.get('rows', 0)} rows match the manifest"
    )
    return 0


def _discard(args: argparse.Namespace) -> int:
    from eagle3_data.storage import IncompleteStage

    bucket, prefix, ref = parse_stage_uri(args.uri)
    store = open_store(args, bucket, prefix)
    store.check_bucket()
    if not store.is_complete(ref) and not store.objects(ref):
        raise IncompleteStage(f"{store.uri(ref)}: nothing there to discard")
    downstream = store.downstream(ref)
    targets = [ref, *downstream] if args.cascade else [ref]
    from eagle3_data.storage.archive import discard_stages

    archived = discard_stages(store, targets, "eagle3-data stage discard")  # StageBusy: a writer holds one
    for target in targets:
        print(f"discarded {store.uri(target)}")
    for uri in archived:
        print(f"paid answers archived to {uri}: a later run of the stage takes back those that still match")
    if downstream and not args.cascade:
        print(
            f"{len(downstream)} downstream stages list it as an input and are now stale (rerun them, or discard "
            f"with --cascade):",
            file=sys.stderr,
        )
        for other in downstream:
            print(f"  {store.uri(other)}", file=sys.stderr)
    elif not downstream:
        print("no downstream stage lists it as an input")
    return 0
