"""The tokenizer audit: every special id the pipeline uses, derived by name and round-tripped,
and the expected ids checked (the model family's published ones and whatever the config pins),
before anything is spent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_data.chat_format import find_output_format
from eagle3_data.codec import check_token
from eagle3_data.tokenizer import chat_template_sha256, tokenizer_files_sha256


@dataclass
class AuditReport:
    special_ids: dict[str, int]
    tokenizer_sha256: str | None
    chat_template_sha256: str | None
    output_format: str | None
    vocab_size: int
    problems: list[str] = field(default_factory=list)
    expected: dict[str, int] = field(default_factory=dict)  # every id checked: the family's, then the config's

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


def audit_tokenizer(tokenizer: Any, expect: dict[str, int] | None = None, family: str | None = None) -> AuditReport:
    """Derive every special id the pipeline uses by name, round-trip each, check expectations:
    the family's `reference_ids` (`family`: `model.family`, else detected from the tokenizer) and
    `expect` (the config's additions; one that contradicts the family's fails as a wrong id).

    An expectation that names the wrong id is the costly mistake (an id that decodes to ordinary
    text where the stop token was meant), so its message says what the expected id really decodes
    to and the right id.
    """
    fmt_cls = find_output_format(tokenizer, family)
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
    reference = dict(fmt_cls.reference_ids) if fmt_cls else {}
    checks = list(reference.items()) + [(n, i) for n, i in (expect or {}).items() if reference.get(n) != i]
    for name, want in checks:
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
    if fmt_cls is not None and fmt_cls.stop_token not in reference and fmt_cls.stop_token not in (expect or {}):
        problems.append(
            f"the expectations do not pin the stop token {fmt_cls.stop_token!r} of format {fmt_cls.name}: add it "
            f"to the format's reference_ids (or tokenizer.expected_special_ids) so a wrong stop id fails here, "
            f"before any spend"
        )
    return AuditReport(
        special_ids=special_ids,
        tokenizer_sha256=tokenizer_files_sha256(tokenizer),
        chat_template_sha256=chat_template_sha256(tokenizer),
        output_format=fmt_cls.name if fmt_cls else None,
        vocab_size=vocab_size,
        problems=problems,
        expected={**reference, **(expect or {})},
    )
