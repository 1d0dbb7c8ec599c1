"""The dev builds have one home: `make demo`, `make airflow` and `make cluster` (the devtools
stack) use the very folders the CLI's `dev:` sources resolve to, under $EAGLE3_DATA_CACHE/dev,
instead of a second 87 MB copy under the checkout's .cache/ (issue 32, item 4). The builders are
replaced by stand-ins that only name their folder: which folder is the point, not the build."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_devtools_stack_and_the_cli_share_the_dev_builds(tmp_path, monkeypatch):
    import eagle3_data.builds.kimi_tokenizer as kimi
    import eagle3_data.builds.tiny_kimi_k25 as tiny
    from eagle3_data.config import load_config, resolve_source
    from eagle3_devtools import stack

    monkeypatch.setenv("EAGLE3_DATA_CACHE", str(tmp_path))
    monkeypatch.setattr(kimi, "cached_kimi_tokenizer", lambda root: Path(root) / "kimi-tokenizer")
    monkeypatch.setattr(tiny, "cached_tiny_kimi_k25", lambda tok, root, **kw: Path(root) / "tiny-kimi-k25")
    assert stack.tokenizer_dir() == Path(resolve_source("dev:kimi-tokenizer")) == tmp_path / "dev" / "kimi-tokenizer"
    # the stack's target is the packaged default's model.source, whatever that names
    assert (
        stack.target_model_dir()
        == Path(resolve_source(load_config().model.source))
        == Path(resolve_source("dev:tiny-kimi-k25"))
        == tmp_path / "dev" / "tiny-kimi-k25"
    )


def test_the_default_target_is_kimi_k25s_own_class(tiny_kimi_k25_dir):
    """The packaged default config's model (what `make demo` and the DAG on the dev stack run on,
    tests/fixtures/airflow.py) is the tiny Kimi-K2.5: its config.json names the real model's
    class, not the text-only DeepSeek-V3 build that stood in before (issue 30, item 1)."""
    from eagle3_devtools import stack
    from tests.conftest import CACHE

    model = stack.target_model_dir(CACHE)  # the test stacks' builds folder: the fixture's build, no second one
    assert model == tiny_kimi_k25_dir
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and "vision_config" in cfg
