"""Where a dataset's prompt files are: its files under a source (a folder or an s3:// prefix),
and its newest `date=YYYY-MM-DD/` partition.

Resolving a run (which partition a scheduled run reads) needs this before any stage runs, so it
sits below the stages; the prompts stage reads the files it names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from eagle3_data.errors import UserError

DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise UserError(f"invalid S3 URI {uri!r}: expected s3://bucket/key")
    return bucket, key


def prompt_files(source: str, dataset: str, *, date: str | None = None, client=None) -> list[str]:
    """The URIs of the prompt files `load_prompts` would read for this dataset and date, without
    reading them: a cheap check that a partition is in place (UserError naming where it looked)."""
    return [f.uri for f in resolve_files(source, dataset, date, client)]


def newest_partition(source: str, dataset: str, *, client=None) -> str | None:
    """The newest YYYY-MM-DD of `{source}/{dataset}/date=YYYY-MM-DD/` folders holding prompt
    files; None when there is none. What a run without a logical date reads when the source has
    no undated file for the dataset (a manual trigger of a scheduled deployment). A source that
    is not there at all: NoSuchSource (no partitions to look for)."""
    if not _source_exists(source, client):
        raise _no_such(source, dataset)
    if source.startswith("s3://"):
        from eagle3_data.storage.client import s3_errors

        bucket, key = _split_s3(source)
        prefix = "/".join(p for p in (key.strip("/"), dataset) if p) + "/"
        with s3_errors(client, f"listing date partitions under {source}"):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
            names = [c["Prefix"][len(prefix) :].rstrip("/") for page in pages for c in page.get("CommonPrefixes", [])]
    else:
        folder = Path(source) / dataset
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    dates = sorted(
        (n.removeprefix("date=") for n in names if n.startswith("date=") and DATE_PATTERN.fullmatch(n[5:])),
        reverse=True,
    )
    for date in dates:  # an empty partition (an upload under way, a mistake) is passed over
        try:
            prompt_files(source, dataset, date=date, client=client)
        except UserError:
            continue
        return date
    return None


def resolve_files(source: str, dataset: str, date: str | None, client) -> list[PromptFile]:
    if source.startswith("s3://"):
        if client is None:
            raise UserError(f"prompts {source}: an s3:// source needs the caller's S3 client (client=...)")
        return _resolve_s3(source, dataset, date, client)
    return _resolve_local(Path(source), dataset, date)


def _no_such(source: str, dataset: str) -> NoSuchSource:
    if source.rstrip("/").endswith(PROMPT_FILE_SUFFIXES):
        return NoSuchSource(f"prompts file {source}: no such file (dataset {dataset})")
    return NoSuchSource(f"prompts {source}: no such file or folder (dataset {dataset})")


def _source_exists(source: str, client) -> bool:
    """Whether anything is at `source`: a local file or folder, an s3:// key or prefix (a bucket's
    root always counts)."""
    if not source.startswith("s3://"):
        return Path(source).exists()
    if client is None:
        raise UserError(f"prompts {source}: an s3:// source needs the caller's S3 client (client=...)")
    from eagle3_data.storage.client import s3_errors

    bucket, key = _split_s3(source)
    if not key.strip("/"):
        return True
    with s3_errors(client, f"listing {source}"):
        return bool(client.list_objects_v2(Bucket=bucket, Prefix=key.strip("/"), MaxKeys=1).get("Contents"))


PROMPT_FILE_SUFFIXES = (".jsonl", ".parquet", ".arrow")  # .arrow: a `datasets` save_to_disk folder's files


# -- files --------------------------------------------------------------------------------------------
@dataclass
class PromptFile:
    uri: str
    size: int
    bucket: str | None = None
    key: str | None = None
    path: Path | None = None


class NoSuchSource(UserError):
    """The prompts source itself is not there (a local path that does not exist, an s3:// URI with
    nothing under it): "no such file" comes first, not advice about date partitions."""


def _prompt_files(names: list[str]) -> list[str]:
    return sorted(
        n for n in names if n.endswith(PROMPT_FILE_SUFFIXES) and not n.rsplit("/", 1)[-1].startswith(("_", "."))
    )


def _candidates(base: str, dataset: str, date: str | None, sep: str = "/") -> list[str]:
    """Files (no trailing sep) and folders (trailing sep) to try, in order; see the module docstring."""
    join = lambda *parts: sep.join(p for p in parts if p)  # noqa: E731
    if date is not None:
        return [join(base, dataset, f"date={date}") + sep]
    out = [base] if base else []
    out += [join(base, f"{dataset}{suffix}") for suffix in PROMPT_FILE_SUFFIXES] + [join(base, dataset) + sep]
    if base.rsplit(sep, 1)[-1] == dataset:  # a folder named after the dataset holds its files
        out.append(base + sep)
    return out


def _resolve_local(root: Path, dataset: str, date: str | None) -> list[PromptFile]:
    if not root.exists():
        raise _no_such(str(root), dataset)
    if date is None and (root / "state.json").is_file():
        return _saved_dataset(root)
    candidates = _candidates(str(root).rstrip("/"), dataset, date)
    for c in candidates:
        path = Path(c)
        if not c.endswith("/") and path.is_file():
            if not c.endswith(PROMPT_FILE_SUFFIXES):
                raise UserError(
                    f"prompts {path}: unsupported file type {path.suffix or '(none)'!r}: expected "
                    f"{' or '.join(PROMPT_FILE_SUFFIXES)} (chat rows: messages, conversations or prompt)"
                )
            return [PromptFile(uri=str(path), size=path.stat().st_size, path=path)]
        if c.endswith("/") and path.is_dir():
            files = _prompt_files([str(p) for p in path.iterdir() if p.is_file()])
            if files:
                return [PromptFile(uri=f, size=Path(f).stat().st_size, path=Path(f)) for f in files]
    raise UserError(
        f"no prompt files (*.jsonl, *.parquet, *.arrow) for dataset {dataset!r}: looked at {', '.join(candidates)}"
    )


def _saved_dataset(root: Path) -> list[PromptFile]:
    """The Arrow files of a `datasets.Dataset.save_to_disk` folder, in its state.json's order (a
    DatasetDict's folder holds one such folder per split: name the split's)."""
    try:
        names = [d["filename"] for d in json.loads((root / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"prompts {root}: state.json is not a `datasets` save_to_disk state ({exc!r})") from None
    files = [root / n for n in names]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise UserError(f"prompts {root}: state.json lists files that are not there: {', '.join(missing[:3])}")
    return [PromptFile(uri=str(f), size=f.stat().st_size, path=f) for f in files]


def _resolve_s3(source: str, dataset: str, date: str | None, client) -> list[PromptFile]:
    from eagle3_data.storage.client import s3_errors

    bucket, key = _split_s3(source)
    candidates = _candidates(key.strip("/"), dataset, date)
    with s3_errors(client, f"listing prompt files under {source}"):
        for c in candidates:
            page_iter = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=c, Delimiter="/")
            objects = {o["Key"]: o["Size"] for page in page_iter for o in page.get("Contents", [])}
            if not c.endswith("/") and c in objects:
                if not c.endswith(PROMPT_FILE_SUFFIXES):
                    raise UserError(
                        f"prompts s3://{bucket}/{c}: unsupported file type: expected "
                        f"{' or '.join(PROMPT_FILE_SUFFIXES)}"
                    )
                return [PromptFile(uri=f"s3://{bucket}/{c}", size=objects[c], bucket=bucket, key=c)]
            if c.endswith("/"):
                keys = _prompt_files(list(objects))
                if keys:
                    return [PromptFile(uri=f"s3://{bucket}/{k}", size=objects[k], bucket=bucket, key=k) for k in keys]
    if not _source_exists(source, client):
        raise _no_such(source, dataset)
    raise UserError(
        f"no prompt files (*.jsonl, *.parquet, *.arrow) for dataset {dataset!r} under {source}: looked at "
        + ", ".join(f"s3://{bucket}/{c}" for c in candidates)
    )
