"""The build-once cache behind the tokenizer / tiny-model fixtures, the dev stack and benchmarks."""

from __future__ import annotations

import re
import threading

import pytest

from eagle3_data.builds.build_cache import cached_build


def writer(calls: list, barrier: threading.Barrier | None = None):
    def build(out):
        calls.append(out)
        if barrier is not None:
            barrier.wait(timeout=10)  # both builders are mid-build at the same time
        (out / "part").write_text("x")
        (out / "done").write_text("ok")

    return build


def test_built_once_per_key_and_keyed_by_content(tmp_path):
    calls: list = []
    a = cached_build(tmp_path, "thing", b"v1", "done", writer(calls))
    assert cached_build(tmp_path, "thing", b"v1", "done", writer(calls)) == a and len(calls) == 1
    b = cached_build(tmp_path, "thing", b"v2", "done", writer(calls))
    assert b != a and len(calls) == 2
    assert re.fullmatch(r"thing-[0-9a-f]{16}", a.name) and (a / "done").read_text() == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])  # no temporary dirs left


def test_failed_build_leaves_nothing(tmp_path):
    def broken(out):
        (out / "part").write_text("x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed"):
        cached_build(tmp_path, "thing", b"v1", "done", broken)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builders_end_with_one_complete_entry(tmp_path):
    calls: list = []
    barrier = threading.Barrier(2)
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(cached_build(tmp_path, "thing", b"v1", "done", writer(calls, barrier)))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in results[0].iterdir()) == ["done", "part"]
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


def test_partial_entry_from_a_non_atomic_builder_is_replaced(tmp_path):
    calls: list = []
    stale = tmp_path / cached_build(tmp_path / "probe", "thing", b"v1", "done", writer(calls)).name
    stale.mkdir()
    (stale / "half-written").write_text("")
    out = cached_build(tmp_path, "thing", b"v1", "done", writer(calls))
    assert out == stale and sorted(p.name for p in out.iterdir()) == ["done", "part"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["probe", out.name])


def test_fixtures_use_the_library_cache(kimi_tokenizer_dir, tiny_model_dir):
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.builds.tiny_model import cached_tiny_model
    from tests.fixtures.model import TINY_MODEL_ARGS

    assert re.fullmatch(r"kimi-tokenizer-[0-9a-f]{16}", kimi_tokenizer_dir.name)
    assert cached_kimi_tokenizer(kimi_tokenizer_dir.parent) == kimi_tokenizer_dir
    assert cached_tiny_model(kimi_tokenizer_dir, tiny_model_dir.parent, **TINY_MODEL_ARGS) == tiny_model_dir
