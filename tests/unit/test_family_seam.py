"""A model family is one module: chat_format/<family>.py holds every token it names.

The scan takes every family's token strings and published ids from the registered formats, so
it stays true when a third family registers: nothing in the library (outside chat_format/ and
the dev builds under builds/), the DAG or the plugins may name one. Then the choice of family:
`model.family` against a tokenizer of another family is refused, and a Qwen3 config audits on
Qwen3's published ids alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from eagle3_data.chat_format import FORMATS, find_output_format, get_output_format
from eagle3_data.config import DEFAULT_CONFIG_PATH, load_config
from eagle3_data.errors import UserError
from eagle3_data.stages.audit.tokenizer_audit import audit_tokenizer

REPO = Path(__file__).resolve().parents[2]
SCANNED = [REPO / "include" / "eagle3_data", REPO / "dags", REPO / "plugins"]
FAMILY_HOMES = [REPO / "include" / "eagle3_data" / "chat_format", REPO / "include" / "eagle3_data" / "builds"]


def family_names() -> tuple[set[str], set[int]]:
    """Every registered family's token strings (structural, published, image placeholder) and ids."""
    names: set[str] = set()
    ids: set[int] = set()
    for cls in FORMATS.values():
        names |= set(cls.structural_tokens) | set(cls.reference_ids) | {cls.stop_token}
        names |= {cls.media_pad} if cls.media_pad else set()
        ids |= set(cls.reference_ids.values())
    return names, ids


def named_outside(roots: list[Path], homes: list[Path]) -> list[str]:
    names, ids = family_names()
    pattern = re.compile(
        "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
        + r"|(?<![\w.])(?:"
        + "|".join(str(i) for i in sorted(ids))
        + r")(?![\w.])"
    )
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or any(path.is_relative_to(h) for h in homes):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if match := pattern.search(line):
                    found.append(f"{path.relative_to(root.parent)}:{number}: {match.group(0)}")
    return found


def test_no_family_token_or_id_is_named_outside_its_module():
    assert {"kimi_k2", "qwen3"} <= set(FORMATS)
    found = named_outside(SCANNED, FAMILY_HOMES)
    assert not found, "family tokens named outside chat_format/:\n" + "\n".join(found)


def test_the_scan_sees_a_token_and_an_id(tmp_path):
    """The scan can fail: a Kimi token in a comment and a Qwen3 id in code are both found."""
    kimi, qwen3 = FORMATS["kimi_k2"], FORMATS["qwen3"]
    (tmp_path / "a.py").write_text(f"x = 1  # ends with {kimi.stop_token}\n")
    (tmp_path / "b.yaml").write_text(
        f"stop: {qwen3.reference_ids[qwen3.stop_token]}\nother: 1{qwen3.reference_ids[qwen3.stop_token]}\n"
    )
    assert [f.rsplit(": ", 1)[1] for f in named_outside([tmp_path], [])] == [
        kimi.stop_token,
        str(qwen3.reference_ids[qwen3.stop_token]),
    ]


def test_every_family_says_how_it_is_served():
    for cls in FORMATS.values():
        assert cls.stop_token in cls.reference_ids, cls.name
        for attr in ("vllm_reasoning_parser", "vllm_tool_parser", "sglang_reasoning_parser", "sglang_tool_parser"):
            assert isinstance(getattr(cls, attr), str) and getattr(cls, attr), (cls.name, attr)


def _config(tmp_path: Path, tokenizer: str | None = None, **model) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    raw["model"].update(model)
    if tokenizer:
        raw["tokenizer"]["source"] = tokenizer
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_named_family_refuses_another_familys_tokenizer(kimi_tokenizer, tmp_path):
    config = load_config(_config(tmp_path, family="qwen3"))
    with pytest.raises(UserError, match="model.family is 'qwen3' but tokenizer .* 'kimi_k2'") as refused:
        get_output_format(kimi_tokenizer, config.model.family, thinking=True)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="'kimi_k2'"):
        audit_tokenizer(kimi_tokenizer, config.tokenizer.expected_special_ids, config.model.family)
    assert find_output_format(kimi_tokenizer, "kimi_k2") is FORMATS["kimi_k2"]
    assert find_output_format(kimi_tokenizer) is FORMATS["kimi_k2"]  # unset: detected, as before
    with pytest.raises(UserError, match="model.family"):
        load_config(_config(tmp_path, family="llama"))


def test_a_qwen3_config_audits_on_the_familys_ids_alone(qwen3_tokenizer, tmp_path):
    """dev:qwen3-tokenizer (the fixture is that build) with the Qwen3 family and no pins."""
    config = load_config(_config(tmp_path, "dev:qwen3-tokenizer", family="qwen3"))
    assert config.tokenizer.expected_special_ids == {}
    report = audit_tokenizer(qwen3_tokenizer, config.tokenizer.expected_special_ids, config.model.family)
    assert report.passed, report.problems
    assert report.output_format == "qwen3" and report.expected == FORMATS["qwen3"].reference_ids
    # a config pin that contradicts the family's is checked too, and fails
    stop = FORMATS["qwen3"].stop_token
    wrong = audit_tokenizer(qwen3_tokenizer, {stop: 1}, "qwen3")
    assert any(p.startswith(f"expected {stop}=1,") for p in wrong.problems), wrong.problems


def test_the_kimi_audit_checks_its_published_ids_without_config_pins(kimi_tokenizer):
    from eagle3_data.chat_format.kimi_k2 import KimiK2Format

    report = audit_tokenizer(kimi_tokenizer, load_config().tokenizer.expected_special_ids)
    assert report.passed, report.problems
    assert report.expected == KimiK2Format.reference_ids
