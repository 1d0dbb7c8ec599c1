"""Load a tokenizer (HF directory or S3 prefix), fingerprint it, audit its special tokens.

The HF tokenizer is the definition of truth. Bulk encode/decode goes through a `Codec`: either
the HF backend itself, or a tiktoken Encoding that a format builds from the same vocabulary and
proves equal to the HF tokenizer on a probe before it is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eagle3_data.cache import cache_root
from eagle3_data.errors import UserError
from eagle3_data.forksafe import PerProcess

# Characters that exercise the pre-tokenizer: scripts, digits, apostrophes, CRLF, emoji, spaces.
PROBE_TEXT = (
    "Hello, world! It's 2026; they'll re-run 12345 NOR ' NOR'.\r\n\n\t  x  \n"
    "中文分词测试，日本語のテキスト。한국어 텍스트. Ünïcödé ÀÉÎ ß ﬁ 😀👍🏽 \u200b "
    "def f(x):\n    return x**2  # ok\n{\"city\": \"Paris\", \"n\": [1, 2.5e-3]}"
)


class Codec(Protocol):
    """Bulk id <-> text, special tokens recognised in text and kept on decode."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Model-produced text: special-token names in it are ordinary text, never special ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Exact bytes: a cut inside a multi-byte character must not compare equal to U+FFFD."""
        ...


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


_HF_FLAG_LOCK = threading.Lock()  # guards HF backends' `encode_special_tokens` (see encode_ordinary_batch)


class HFCodec:
    """Encode/decode through the HF tokenizer (fast backend's batch API when there is one)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.backend is not None:
            with _HF_FLAG_LOCK:
                return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.backend is None:
            return [self.tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]
        # The flag is backend state (a private copy costs seconds of JSON): set it only for this
        # call, under the lock every HFCodec encode takes, so prompts keep parsing their specials.
        with _HF_FLAG_LOCK:
            self.backend.encode_special_tokens = True
            try:
                return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
            finally:
                self.backend.encode_special_tokens = False

    def decode(self, ids: Sequence[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        from tokenizers import decoders

        if self.backend is None or not isinstance(self.backend.decoder, decoders.ByteLevel):
            return self.decode(ids).encode("utf-8")
        added = {tid: tok.content for tid, tok in self.backend.get_added_tokens_decoder().items()}
        table = _byte_level_decoder()
        out = bytearray()
        for tid in ids:
            if tid in added:
                out += added[tid].encode("utf-8")
            else:
                out += bytes(table[c] for c in self.backend.id_to_token(tid))
        return bytes(out)


class TiktokenCodec:
    """tiktoken over the same vocabulary: several times faster than the HF backend. Batches are
    encoded on a persistent thread pool (tiktoken releases the GIL while encoding), one per
    process: a task forked from a warm Celery worker that verified the codec builds its own."""

    def __init__(self, encoding: Any, num_threads: int | None = None):
        self.encoding = encoding
        self.num_threads = num_threads or min(4, os.cpu_count() or 1)
        self._pool = PerProcess(lambda: ThreadPoolExecutor(self.num_threads, thread_name_prefix="tiktoken"),
                                discard=lambda pool: pool.shutdown(wait=False))
        self._encode = functools.partial(encoding.encode, allowed_special="all")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._map(self._encode, texts)

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._map(self.encoding.encode_ordinary, texts)

    def _map(self, fn: Any, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) < 2 or self.num_threads < 2:
            return [fn(t) for t in texts]
        return list(self._pool.get().map(fn, texts, chunksize=max(1, len(texts) // (4 * self.num_threads))))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(ids)


def codecs_agree(a: Codec, b: Codec, vocab_size: int, special_names: Sequence[str]) -> str | None:
    """None when `a` and `b` agree on the probe text and every special token; else what differs."""
    texts = [PROBE_TEXT, "".join(special_names), PROBE_TEXT.join(special_names[:8])]
    for text, ea, eb in zip(texts, a.encode_batch(texts), b.encode_batch(texts)):
        if ea != eb:
            return f"encode({text[:40]!r}...) differs"
        if a.decode(ea) != b.decode(eb):
            return f"decode of {text[:40]!r}... differs"
    if a.encode_ordinary_batch(texts) != b.encode_ordinary_batch(texts):
        return "ordinary encode (special-token names as text) differs"
    sample = list(range(0, vocab_size, max(1, vocab_size // 4096)))
    if a.decode(sample) != b.decode(sample):
        return "decode of sampled ids differs"
    return None


def tiktoken_encoding(vocab_file: str | Path, pattern: str, specials: dict[str, int]):
    import binascii

    import tiktoken

    # tiktoken's own loader goes through base64.b64decode per line: 3x slower at every start.
    ranks = {
        binascii.a2b_base64(token): int(rank)
        for token, rank in (line.split() for line in Path(vocab_file).read_bytes().splitlines() if line)
    }
    return tiktoken.Encoding(
        Path(vocab_file).parent.name,
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={name: tid for name, tid in specials.items() if tid >= len(ranks)},
    )


class TiktokenTokenizer:
    """The part of the HF tokenizer interface that bulk commands use, backed by tiktoken alone.

    Only built from a verification record: a previous run loaded the HF tokenizer with the very
    same files (sha256) and proved the tiktoken codec equal to it. Saves transformers' import and
    the multi-second `tokenizer.json` load at every start of a bulk command.
    """

    def __init__(self, path: Path, record: dict[str, Any]):
        self.name_or_path = str(path)
        self._added = dict(record["special_tokens"])
        self._vocab_size = int(record["vocab_size"])
        self.model = tiktoken_encoding(path / "tiktoken.model", record["pattern"], self._added)
        self.chat_template = None
        # the HF tokenizer's template hash: stage params (reuse) stay the same on either loader
        self.template_sha256: str | None = record["template_sha256"]

    def __len__(self) -> int:
        return self._vocab_size

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._added)

    def convert_tokens_to_ids(self, name: str) -> int | None:
        return self._added.get(name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.model.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return self.model.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise UserError("this command loaded the tokenizer without its chat template (bulk mode)")


def _verified_dir() -> Path:
    return cache_root() / "verified-codecs"


def load_bulk_tokenizer(source: str | os.PathLike, *, trust_remote_code: bool = False, s3_client: Any = None):
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
    source: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    cache_dir: str | None = None,
    s3_client: Any = None,
):
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


def check_token(tokenizer: Any, name: str) -> tuple[int | None, list[str]]:
    """The id of token `name` and the problems with it: it must encode to one id that decodes back."""
    tid = tokenizer.convert_tokens_to_ids(name)
    unk = getattr(tokenizer, "unk_token_id", None)
    if tid is None or (tid == unk and name != getattr(tokenizer, "unk_token", None)):
        return None, [f"{name!r} is not in the vocabulary"]
    problems = []
    encoded = tokenizer.encode(name, add_special_tokens=False)
    if encoded != [tid]:
        problems.append(f"encode({name!r}) = {encoded}, not [{tid}]")
    decoded = tokenizer.decode([tid], skip_special_tokens=False)
    if decoded != name:
        problems.append(f"decode([{tid}]) = {decoded!r}, not {name!r}")
    return tid, problems


@dataclass
class AuditReport:
    special_ids: dict[str, int]
    tokenizer_sha256: str | None
    chat_template_sha256: str | None
    output_format: str | None
    vocab_size: int
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "output_format": self.output_format,
            "vocab_size": self.vocab_size,
            "special_ids": self.special_ids,
            "tokenizer_sha256": self.tokenizer_sha256,
            "chat_template_sha256": self.chat_template_sha256,
            "problems": self.problems,
        }


def audit_tokenizer(tokenizer: Any, expect: dict[str, int] | None = None) -> AuditReport:
    """Derive every special id the pipeline uses by name, round-trip each, check expectations.

    An expectation that names the wrong id is the costly mistake (163533 is "chas", not
    `<|im_end|>`), so its message says what the configured id really decodes to and the right id.
    """
    from eagle3_data.chat_format import find_output_format

    fmt_cls = find_output_format(tokenizer)
    names = list(fmt_cls.structural_tokens) if fmt_cls else []
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, str) and value not in names:
            names.append(value)
    special_ids: dict[str, int] = {}
    problems: list[str] = []
    for name in names:
        tid, errs = check_token(tokenizer, name)
        if tid is not None:
            special_ids[name] = tid
        problems += errs
    vocab_size = len(tokenizer)
    for name, want in (expect or {}).items():
        actual = tokenizer.convert_tokens_to_ids(name)
        in_vocab = actual is not None and tokenizer.convert_ids_to_tokens(actual) == name
        if in_vocab and actual == want:
            continue
        if not 0 <= want < vocab_size:
            really = f"is outside the vocabulary (size {vocab_size})"
        else:
            really = f"decodes to {tokenizer.decode([want], skip_special_tokens=False)!r}"
        right = f"{name!r} is {actual}" if in_vocab else f"{name!r} is not a token of this tokenizer"
        problems.append(f"expected {name}={want}, but id {want} {really}; {right}")
    return AuditReport(
        special_ids=special_ids,
        tokenizer_sha256=tokenizer_files_sha256(tokenizer),
        chat_template_sha256=chat_template_sha256(tokenizer),
        output_format=fmt_cls.name if fmt_cls else None,
        vocab_size=vocab_size,
        problems=problems,
    )
