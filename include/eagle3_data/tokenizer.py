"""Load a tokenizer (HF directory or S3 prefix) and fingerprint it.

The HF tokenizer is the definition of truth; bulk commands start on its verified tiktoken fast
path (`codec.TiktokenTokenizer`) once these exact files were proven equal to it on this host
(`load_bulk_tokenizer`). The audit of its special ids is `tokenizer_audit`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from eagle3_data.cache import cache_root
from eagle3_data.codec import TiktokenCodec, TiktokenTokenizer
from eagle3_data.errors import UserError


def _verified_dir() -> Path:
    return cache_root() / "verified-codecs"


def load_bulk_tokenizer(
    source: str | os.PathLike[str], *, trust_remote_code: bool = False, s3_client: Any = None
) -> Any:
    """For bulk encode/decode (validate, reconstruct): a `TiktokenTokenizer` when these exact files
    were verified before, else the HF tokenizer (verifying now, and recording it for next time)."""
    from eagle3_data.chat_format import get_output_format

    is_s3 = str(source).startswith("s3://")
    local = _fetch_s3_prefix(str(source), None, s3_client) if is_s3 else Path(source)
    if local.is_dir() and (local / "tiktoken.model").is_file():
        sha = _dir_sha256(local)
        record_path = _verified_dir() / f"{sha}.json"
        if record_path.is_file() and "template_sha256" in (record := json.loads(record_path.read_text())):
            return TiktokenTokenizer(local, record)  # (a record without the template hash is rewritten below)
    tokenizer = load_tokenizer(local, trust_remote_code=trust_remote_code)
    fmt = get_output_format(tokenizer, thinking=True)  # either mode: only its codec is recorded
    pattern = getattr(fmt, "pattern", None)
    if isinstance(fmt.codec, TiktokenCodec) and pattern and (local / "tiktoken.model").is_file():
        record = {
            "format": fmt.name,
            "pattern": pattern,
            "special_tokens": tokenizer.get_added_vocab(),
            "vocab_size": len(tokenizer),
            "tokenizer_sha256": sha,
            "template_sha256": chat_template_sha256(tokenizer),
        }
        record_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = record_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(record_path)
    return tokenizer


def load_tokenizer(
    source: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    cache_dir: str | None = None,
    s3_client: Any = None,
) -> Any:
    """AutoTokenizer from a local directory or an `s3://bucket/prefix` (downloaded once into
    `cache_dir`, keyed by the objects' ETags) through the caller's `s3_client` (default:
    `storage.s3_client()` from the environment)."""
    from transformers import AutoTokenizer

    is_s3 = str(source).startswith("s3://")
    local = _fetch_s3_prefix(str(source), cache_dir, s3_client) if is_s3 else Path(source)
    if not local.is_dir():
        raise UserError(f"--tokenizer {source}: not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(local), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UserError(f"tokenizer {source}: needs custom code; pass --trust-remote-code") from exc
        raise UserError(f"tokenizer {source}: {exc}") from exc
    except OSError as exc:
        raise UserError(f"tokenizer {source}: cannot load: {exc}") from exc


def _fetch_s3_prefix(uri: str, cache_dir: str | None, s3: Any) -> Path:
    """Copy the objects under an S3 prefix into a cache folder keyed by the URI and their ETags.
    `s3`: the caller's client (Airflow: aws_default's); without one, `storage.s3_client()` from the
    environment, with the same retries and one-line outage errors as every other S3 access."""
    from eagle3_data.storage.client import s3_client, s3_errors

    s3 = s3 if s3 is not None else s3_client()
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    objects = []
    with s3_errors(s3, f"listing the tokenizer files under {uri}"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objects += [o for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    if not objects:
        raise UserError(f"tokenizer {uri}: no objects under that prefix")
    key = hashlib.sha256(json.dumps([uri] + sorted((o["Key"], o["ETag"]) for o in objects)).encode()).hexdigest()
    root = Path(cache_dir or cache_root() / "tokenizers") / key[:16]
    if not (root / ".complete").exists():
        for o in objects:
            dest = root / o["Key"][len(prefix) :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with s3_errors(s3, f"downloading s3://{bucket}/{o['Key']}"):
                s3.download_file(bucket, o["Key"], str(dest))
        (root / ".complete").write_text(uri)
    return root


def tokenizer_files_sha256(tokenizer: Any) -> str | None:
    """sha256 over the tokenizer directory's files (names and bytes), None without a directory."""
    root = Path(getattr(tokenizer, "name_or_path", "") or "")
    return _dir_sha256(root) if root.is_dir() else None


def _dir_sha256(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def chat_template_sha256(tokenizer: Any) -> str | None:
    if isinstance(tokenizer, TiktokenTokenizer):
        return tokenizer.template_sha256  # recorded from the HF tokenizer of the same files
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return hashlib.sha256(template.encode()).hexdigest() if template else None


def tokenizer_hashes(tokenizer: Any) -> dict[str, str | None]:
    """What a stage's manifest records of the tokenizer its rows were made with (`tokenizer_sha256`,
    `template_sha256`): the merge refuses to mix stages whose hashes differ."""
    return {"tokenizer_sha256": tokenizer_files_sha256(tokenizer), "template_sha256": chat_template_sha256(tokenizer)}
