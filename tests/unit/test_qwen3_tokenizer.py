"""`dev:qwen3-tokenizer` (rebuilt from splintr-rs) encodes as splintr's own Qwen3 encoder does,
which shares no code with the HF tokenizer we build: corpus with every added token, scripts,
code, whitespace runs and emoji."""

from __future__ import annotations

import unicodedata

import pytest

from tests.fixtures.qwen3 import CALL_BEGIN, IM_END, IMAGE_PAD, NUM_TOKENS, THINK, THINK_END

CORPUS = [
    "Hello, world! It's 2026; they'll re-run 12345 NOR ' NOR'.\r\n\n\t  x  \n",
    "中文分词测试，日本語のテキスト。한국어 텍스트. Ünïcödé ÀÉÎ ß ﬁ 😀👍🏽 \u200b Привет, мир! مرحبا",
    'def f(x):\n    return x**2  # ok\n{"city": "Paris", "n": [1, 2.5e-3]}\n\n\n    \t\t',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nsum\n</think>\n\n4<|im_end|>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_response>\nok\n</tool_response>',
    "<|endoftext|><|object_ref_start|><|object_ref_end|><|box_start|><|box_end|><|quad_start|><|quad_end|>",
    "<|vision_start|><|vision_end|><|vision_pad|><|image_pad|><|video_pad|>",
    "<|fim_prefix|>a<|fim_middle|>b<|fim_suffix|>c<|fim_pad|><|repo_name|>r<|file_sep|>f",
    "a<think>b</think>c <think> x</think>\n<tool_call>",
    " " * 17 + "\n" * 5 + "end   \t  ",
]


@pytest.fixture(scope="module")
def splintr_qwen3():
    import splintr

    return splintr.Tokenizer.from_pretrained("qwen3")


def test_every_added_token_is_in_the_corpus(qwen3_tokenizer):
    text = "".join(CORPUS)
    missing = [name for name in qwen3_tokenizer.get_added_vocab() if name not in text]
    assert missing == []


@pytest.mark.parametrize("text", CORPUS)
def test_encoding_equals_splintr_and_decodes_back(qwen3_tokenizer, splintr_qwen3, text):
    assert unicodedata.is_normalized("NFC", text)  # splintr does not normalise; Qwen2's tokenizer does
    ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
    assert ids == splintr_qwen3.encode_with_special(text)
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_published_ids_and_flags(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert len(tok) == NUM_TOKENS
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>", "<tool_call>", "<|image_pad|>"]) == [
        IM_END,
        THINK,
        THINK_END,
        CALL_BEGIN,
        IMAGE_PAD,
    ]
    assert tok.eos_token_id == IM_END and tok.bos_token is None
    # the tag tokens are not special: skipping special tokens keeps them, and drops <|im_end|>
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_input_is_nfc_normalised(qwen3_tokenizer, splintr_qwen3):
    decomposed = "Cafe\u0301"
    ids = qwen3_tokenizer.encode(decomposed, add_special_tokens=False)
    assert ids == splintr_qwen3.encode(unicodedata.normalize("NFC", decomposed))


def test_dev_source_resolves(tmp_path):
    from eagle3_data.builds.sources import DEV_SOURCES, resolve_dev_source

    assert "qwen3-tokenizer" in DEV_SOURCES
    built = resolve_dev_source("qwen3-tokenizer", tmp_path)
    assert (built / "tokenizer.json").is_file() and "enable_thinking" in (built / "chat_template.jinja").read_text()
