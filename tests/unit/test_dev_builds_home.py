"""The dev builds have one home: `make demo`, `make airflow` and `make cluster` (the devtools
stack) use the very folders the CLI's `dev:` sources resolve to, under $EAGLE3_DATA_CACHE/dev,
instead of a second 87 MB copy under the checkout's .cache/ (issue 32, item 4). The builders are
replaced by stand-ins that only name their folder: which folder is the point, not the build."""

from __future__ import annotations

from pathlib import Path


def test_the_devtools_stack_and_the_cli_share_the_dev_builds(tmp_path, monkeypatch):
    import eagle3_data.builds.kimi_tokenizer as kimi
    import eagle3_data.builds.tiny_model as tiny
    from eagle3_data.config import resolve_source
    from eagle3_devtools import stack

    monkeypatch.setenv("EAGLE3_DATA_CACHE", str(tmp_path))
    monkeypatch.setattr(kimi, "cached_kimi_tokenizer", lambda root: Path(root) / "kimi-tokenizer")
    monkeypatch.setattr(tiny, "cached_tiny_model", lambda tok, root, **kw: Path(root) / "tiny-deepseek-v3")
    assert stack.tokenizer_dir() == Path(resolve_source("dev:kimi-tokenizer")) == tmp_path / "dev" / "kimi-tokenizer"
    assert (
        stack.tiny_model_dir() == Path(resolve_source("dev:tiny-deepseek-v3")) == tmp_path / "dev" / "tiny-deepseek-v3"
    )
