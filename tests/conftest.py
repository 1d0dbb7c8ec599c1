"""Shared fixtures. Area fixtures live in tests/fixtures/*.py and are registered here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
SHARED = REPO.parent / "shared"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _fresh_machine_caches() -> Path:
    """Every run of the suite is a new machine's first start for what the project caches: the
    library's cache root (verified codecs, journals, s3:// tokenizers, dev: builds) and vLLM's
    are empty folders of this run (`make test` empties its own; a bare `pytest` gets a temp one),
    inherited by every server, CLI and Airflow process the tests start. A developer's warm
    ~/.cache once hid a hang that every new user's first `make cluster` hit."""
    import tempfile

    root = Path(os.environ.get("EAGLE3_DATA_CACHE") or tempfile.mkdtemp(prefix="eagle3-test-cache-"))
    os.environ["EAGLE3_DATA_CACHE"] = str(root)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    return root


TEST_CACHE = _fresh_machine_caches()
USER_CACHE = Path.home() / ".cache" / "eagle3-data"
_USER_CACHE_BEFORE = sorted(USER_CACHE.rglob("*")) if USER_CACHE.exists() else []


def pytest_sessionfinish(session, exitstatus):
    """The suite never reads or writes the user's own cache: a new file there means a code path
    that ignores EAGLE3_DATA_CACHE (and would make a second run take other paths than a first)."""
    after = sorted(USER_CACHE.rglob("*")) if USER_CACHE.exists() else []
    new = [p for p in after if p not in set(_USER_CACHE_BEFORE)]
    if new:
        session.config.get_terminal_writer().line(
            f"FAILED: the suite wrote {len(new)} file(s) under {USER_CACHE} (the user's cache, not "
            f"$EAGLE3_DATA_CACHE): {[str(p) for p in new[:5]]}",
            red=True,
        )
        session.exitstatus = 1


def _share_botocore_loader() -> None:
    """One botocore data loader for every boto3 session of this (the test) process.

    Each new boto3 session re-reads and re-parses botocore's JSON service models (~0.25 s of
    CPU per S3 client), and `dag.test()` runs every task in this process, each opening its
    store through a new `aws_default` session: ~150 tasks in tests/dags alone. The loader only
    caches the read-only files shipped with botocore, so sharing it changes no behaviour; the
    CLI and server subprocesses that tests start still load their own.
    """
    import functools

    import botocore.loaders
    import botocore.session

    botocore.session.create_loader = functools.lru_cache(maxsize=None)(botocore.loaders.create_loader)


_share_botocore_loader()

pytest_plugins = ["tests.hang_report"] + [
    f"tests.fixtures.{p.stem}"
    for p in sorted((Path(__file__).parent / "fixtures").glob("*.py"))
    if p.stem != "__init__"
]


@pytest.fixture(scope="session")
def kimi_tokenizer_dir() -> Path:
    """The real Kimi tokenizer, built once from splintr-rs and cached across runs in .cache/."""
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer

    return cached_kimi_tokenizer(CACHE)


@pytest.fixture(scope="session")
def kimi_tokenizer(kimi_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(kimi_tokenizer_dir))


@pytest.fixture(scope="session")
def reference_chat_template() -> str | None:
    """Moonshot's K2.5 template from ../shared, when that file exists."""
    path = SHARED / "kimi-k2.5" / "chat_template.jinja"
    return path.read_text() if path.exists() else None
