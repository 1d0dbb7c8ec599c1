"""Bulk id <-> text: a `Codec` is either the HF tokenizer's own backend, or a tiktoken Encoding
over the same vocabulary that a format proves equal to the HF tokenizer on a probe before it is
used (several times faster). `TiktokenTokenizer` is the part of the HF tokenizer interface bulk
commands need, on tiktoken alone; `check_token` is the round trip every special id must pass.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from eagle3_data.errors import UserError
from eagle3_data.forksafe import PerProcess

# Characters that exercise the pre-tokenizer: scripts, digits, apostrophes, CRLF, emoji, spaces.
PROBE_TEXT = (
    "Hello, world! It's 2026; they'll re-run 12345 NOR ' NOR'.\r\n\n\t  x  \n"
    "中文分词测试，日本語のテキスト。한국어 텍스트. Ünïcödé ÀÉÎ ß ﬁ 😀👍🏽 \u200b "
    'def f(x):\n    return x**2  # ok\n{"city": "Paris", "n": [1, 2.5e-3]}'
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
        self._pool = PerProcess(
            lambda: ThreadPoolExecutor(self.num_threads, thread_name_prefix="tiktoken"),
            discard=lambda pool: pool.shutdown(wait=False),
        )
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
