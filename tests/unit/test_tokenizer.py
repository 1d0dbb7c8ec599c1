"""Tokenizer loading, fingerprints, the special-token audit, and the tiktoken fast path."""

from __future__ import annotations

import random
import shutil
from types import SimpleNamespace

import pytest

from eagle3_data.chat_format import get_output_format
from eagle3_data.codec import HFCodec, TiktokenCodec
from eagle3_data.errors import UserError
from eagle3_data.stages.audit.tokenizer_audit import audit_tokenizer
from eagle3_data.tokenizer import chat_template_sha256, load_tokenizer, tokenizer_files_sha256


def test_audit_names_the_wrong_id_and_the_right_one(kimi_tokenizer):
    report = audit_tokenizer(kimi_tokenizer, {"<|im_end|>": 163533})
    assert not report.passed
    assert report.problems == ["expected <|im_end|>=163533, but id 163533 decodes to 'chas'; '<|im_end|>' is 163586"]
    good = audit_tokenizer(kimi_tokenizer, {"<|im_end|>": 163586, "</think>": 163607})
    assert good.passed, good.problems
    ids = good.to_json()["special_ids"]
    assert ids["<|im_end|>"] == 163586 and ids["[EOS]"] == 163585 and ids["<|tool_call_end|>"] == 163599
    assert good.output_format == "kimi_k2" and good.vocab_size == 163840
    assert len(good.tokenizer_sha256) == 64 and len(good.chat_template_sha256) == 64


def test_audit_unknown_name_and_out_of_range_id(kimi_tokenizer):
    report = audit_tokenizer(kimi_tokenizer, {"<|nope|>": 5, "<|im_end|>": 999999})
    assert any("'<|nope|>' is not a token of this tokenizer" in p for p in report.problems)
    assert any("id 999999 is outside the vocabulary (size 163840)" in p for p in report.problems)


def test_any_hf_tokenizer_directory_audits(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    report = audit_tokenizer(tok, {"</s>": 3})
    assert report.output_format is None
    assert report.special_ids == {"</s>": 3, "[UNK]": 2}
    assert report.passed, report.problems
    assert not audit_tokenizer(tok, {"</s>": 0}).passed


def test_fingerprints_change_with_files(kimi_tokenizer, kimi_tokenizer_dir, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(kimi_tokenizer_dir, copy)
    before = tokenizer_files_sha256(kimi_tokenizer)
    assert tokenizer_files_sha256(SimpleNamespace(name_or_path=str(copy))) == before
    (copy / "tiktoken.model").write_bytes((copy / "tiktoken.model").read_bytes() + b"\n")
    assert tokenizer_files_sha256(SimpleNamespace(name_or_path=str(copy))) != before
    template = kimi_tokenizer.chat_template
    assert chat_template_sha256(kimi_tokenizer) == chat_template_sha256(SimpleNamespace(chat_template=template))
    assert chat_template_sha256(SimpleNamespace(chat_template=template + " ")) != chat_template_sha256(kimi_tokenizer)


def test_load_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(UserError, match="cannot load|tokenizer"):
        load_tokenizer(tmp_path)


def test_load_from_s3_prefix(kimi_tokenizer_dir, s3_server, s3_bucket, tmp_path):
    client = s3_server.client()
    for path in kimi_tokenizer_dir.iterdir():
        client.upload_file(str(path), s3_bucket, f"models/kimi/{path.name}")
    tok = load_tokenizer(f"s3://{s3_bucket}/models/kimi", cache_dir=str(tmp_path), s3_client=client)
    assert tok.convert_tokens_to_ids("<|im_end|>") == 163586
    assert tokenizer_files_sha256(tok) == tokenizer_files_sha256(SimpleNamespace(name_or_path=str(kimi_tokenizer_dir)))


def _random_text(rng: random.Random) -> str:
    pieces = [
        "Hello",
        " world",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "中文",
        "日本語",
        "한국어",
        "😀",
        "👍🏽",
        "'s",
        "'LL",
        " NOR",
        "123456",
        "3.14",
        "<|im_end|>",
        "</think>",
        "<|tool_call_begin|>",
        "<|im_end",
        "é",
        "ﬁ",
        "def f(x):",
        '{"a": [1]}',
        "\u200b",
        "Ωmega",
        " ",
        "...",
        "ÀÉ",
        "\\n",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))


def test_tiktoken_fast_path_agrees_with_hf(kimi_tokenizer):
    """The HF tokenizer is the definition of truth; the fast codec must give the same ids and text."""
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    assert isinstance(fmt.codec, TiktokenCodec)
    hf = HFCodec(kimi_tokenizer)
    rng = random.Random(7)
    texts = [_random_text(rng) for _ in range(2000)]
    fast_ids = fmt.codec.encode_batch(texts)
    assert fast_ids == hf.encode_batch(texts)
    # model-produced text: special-token names are ordinary text on both (tiktoken's encode_ordinary)
    ordinary = fmt.codec.encode_ordinary_batch(texts)
    assert ordinary == hf.encode_ordinary_batch(texts)
    assert not any(i >= 163584 for ids in ordinary for i in ids)
    for ids in fast_ids[:300]:
        assert fmt.codec.decode(ids) == hf.decode(ids)
    ids = [rng.randrange(163840) for _ in range(20000)]  # arbitrary ids, incl. partial UTF-8 bytes
    for start in range(0, len(ids), 37):
        assert fmt.codec.decode(ids[start : start + 37]) == hf.decode(ids[start : start + 37])
        assert fmt.codec.decode_bytes(ids[start : start + 37]) == hf.decode_bytes(ids[start : start + 37])


def test_audit_requires_the_formats_stop_token_to_be_pinned(kimi_tokenizer, monkeypatch):
    """The expected ids (the family's, then the config's) may name any ids, but not leave out the
    one every generation ends with."""
    from eagle3_data.chat_format.kimi_k2 import IM_END, KimiK2Format

    reference = {n: i for n, i in KimiK2Format.reference_ids.items() if n != IM_END}
    monkeypatch.setattr(KimiK2Format, "reference_ids", reference)
    report = audit_tokenizer(kimi_tokenizer, {"</think>": 163607})
    assert not report.passed
    assert any("do not pin the stop token '<|im_end|>' of format kimi_k2" in p for p in report.problems), (
        report.problems
    )
