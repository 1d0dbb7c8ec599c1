"""`eagle3-data tokenizer audit | reconstruct | validate`: outputs and exit codes 0/1/2."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_data.cli import main
from eagle3_data.codec import TiktokenTokenizer
from eagle3_data.tokenizer import load_bulk_tokenizer
from tests.fixtures.kimi import CHAS, REFERENCE_IDS, THINK_END


@pytest.fixture(scope="module")
def verified_cache(kimi_tokenizer_dir, tmp_path_factory):
    """A verification record for the test tokenizer: the first bulk load checks tiktoken against
    HF and records it; later loads skip transformers."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("eagle3-cache")
    mp.setenv("EAGLE3_DATA_CACHE", str(cache))
    first = load_bulk_tokenizer(kimi_tokenizer_dir)
    assert not isinstance(first, TiktokenTokenizer)
    assert len(list((cache / "verified-codecs").glob("*.json"))) == 1
    yield cache
    mp.undo()


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_second_bulk_load_is_tiktoken_only_and_agrees(verified_cache, kimi_tokenizer_dir, kimi_tokenizer, tmp_path):
    tok = load_bulk_tokenizer(kimi_tokenizer_dir)
    assert isinstance(tok, TiktokenTokenizer)
    assert len(tok) == len(kimi_tokenizer) and tok.get_added_vocab() == kimi_tokenizer.get_added_vocab()
    text = "Let me think.</think>The answer is 42.<|im_end|>"
    assert tok.encode(text) == kimi_tokenizer.encode(text, add_special_tokens=False) == REFERENCE_IDS
    # Different files (sha256) are not covered by the record: back to the HF tokenizer.
    import shutil

    copy = tmp_path / "tok"
    shutil.copytree(kimi_tokenizer_dir, copy)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + "\n")
    assert not isinstance(load_bulk_tokenizer(copy), TiktokenTokenizer)


def test_audit_cli(kimi_tokenizer_dir, capsys):
    assert main(["tokenizer", "audit", "--tokenizer", str(kimi_tokenizer_dir), "--expect", "<|im_end|>=163533"]) == 2
    out, err = capsys.readouterr()
    assert "163533 decodes to 'chas'" in err and "'<|im_end|>' is 163586" in err
    assert json.loads(out)["special_ids"]["<|im_end|>"] == 163586
    assert main(["tokenizer", "audit", "--tokenizer", str(kimi_tokenizer_dir), "--expect", "im_end"]) == 2
    assert "expected NAME=ID" in capsys.readouterr().err


def test_validate_cli_exit_codes(verified_cache, kimi_tokenizer_dir, tmp_path, capsys):
    tok = ["--tokenizer", str(kimi_tokenizer_dir), "--thinking"]
    good = _write(tmp_path / "good.jsonl", [{"sample_id": f"s{i}", "output_ids": REFERENCE_IDS} for i in range(3)])
    report = tmp_path / "out" / "report.json"
    assert main(["validate", *tok, "--input", good, "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["counts"]["exact"] == 3 and data["gate"]["passed"]
    assert "**Gate: PASSED**" in report.with_suffix(".md").read_text()

    wrong_stop = _write(
        tmp_path / "chas.jsonl",
        [
            {
                "sample_id": "x",
                "output_ids": REFERENCE_IDS[:-1] + [CHAS],
                "finish_reason": {"type": "stop", "matched": CHAS},
            }
        ],
    )
    assert main(["validate", *tok, "--input", wrong_stop, "--report", str(report)]) == 1
    assert "wrong_stop" in capsys.readouterr().err
    assert json.loads(report.read_text())["mismatches"][0]["class"] == "wrong_stop"

    # thinking off: the same ids without their `</think>` are exact only in that mode
    off = _write(
        tmp_path / "off.jsonl", [{"sample_id": "o", "output_ids": REFERENCE_IDS[REFERENCE_IDS.index(THINK_END) + 1 :]}]
    )
    plain = ["--tokenizer", str(kimi_tokenizer_dir)]
    assert main(["validate", *plain, "--no-thinking", "--input", off, "--report", str(report)]) == 0
    assert main(["validate", *plain, "--thinking", "--input", off, "--report", str(report)]) == 1
    capsys.readouterr()
    # the mode is required for a file (it carries no run config): the rebuild depends on it
    assert main(["validate", *plain, "--input", off, "--report", str(report)]) == 2
    assert "--thinking or --no-thinking is required" in capsys.readouterr().err

    bad = _write(
        tmp_path / "bad.jsonl",
        [{"sample_id": "a", "output_ids": REFERENCE_IDS}, "{oops", {"sample_id": "c", "output_ids": ["x"]}],
    )
    assert main(["validate", *tok, "--input", bad, "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "invalid JSON" in err and "Traceback" not in err
    assert (
        main(["validate", *tok, "--input", bad, "--report", str(report), "--on-bad-row", "skip"]) == 1
    )  # bad rows count
    assert [b["row"] for b in json.loads(report.read_text())["bad_rows"]] == ["line 2", "line 3"]
    assert (
        main(
            [
                "validate",
                *tok,
                "--input",
                bad,
                "--report",
                str(report),
                "--on-bad-row",
                "skip",
                "--max-bad-row-rate",
                "0.7",
            ]
        )
        == 0
    )
    assert main(["validate", *tok, "--input", str(tmp_path / "missing.jsonl"), "--report", str(report)]) == 2
    assert main(["validate", "--tokenizer", str(tmp_path), "--thinking", "--input", good, "--report", str(report)]) == 2


def test_reconstruct_cli(verified_cache, kimi_tokenizer_dir, tmp_path, capsys):
    rows = [
        {"sample_id": "a", "reasoning": "Let me think.", "content": "The answer is 42.", "finish_reason": "stop"},
        {
            "sample_id": "b",
            "reasoning": "hm",
            "content": "",
            "finish_reason": "tool_calls",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {
            "sample_id": "c",
            "reasoning": "hm",
            "content": "",
            "finish_reason": "length",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    src = _write(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    tok = ["--tokenizer", str(kimi_tokenizer_dir), "--thinking"]
    assert main(["reconstruct", *tok, "--input", src, "--out", str(out)]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got[0] == {"sample_id": "a", "finish_reason": "stop", "output_ids": REFERENCE_IDS, "unreconstructable": None}
    assert 163597 in got[1]["output_ids"]
    assert got[2] == {
        "sample_id": "c",
        "finish_reason": "length",
        "output_ids": None,
        "unreconstructable": "truncated inside tool-call section",
    }
    assert "2 samples, 1 unreconstructable" in capsys.readouterr().out
    assert main(["reconstruct", *tok, "--input", src, "--out", str(tmp_path / "o.parquet")]) == 0
    assert pq.read_table(tmp_path / "o.parquet").column("output_ids").to_pylist()[0] == REFERENCE_IDS
    off = tmp_path / "off.jsonl"  # thinking off: no `</think>` the model never generates
    assert (
        main(
            [
                "reconstruct",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--no-thinking",
                "--input",
                _write(tmp_path / "in_off.jsonl", [{**rows[0], "reasoning": None}]),
                "--out",
                str(off),
            ]
        )
        == 0
    )
    assert json.loads(off.read_text())["output_ids"] == REFERENCE_IDS[REFERENCE_IDS.index(THINK_END) + 1 :]
    bad = _write(tmp_path / "bad.jsonl", [rows[0], {"sample_id": "z", "content": 5, "finish_reason": "stop"}])
    assert main(["reconstruct", *tok, "--input", bad, "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "line 2 (sample_id z): field 'content'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x.jsonl.partial").exists()


def test_dev_s3_prints_the_default_secret_a_client_needs(capsys):
    """A newcomer who started the dev S3 without keys of their own gets the documented default
    secret printed (it is no secret); their own AWS_SECRET_ACCESS_KEY is never echoed."""
    import types

    from eagle3_data.cli.dev_s3 import _print
    from eagle3_data.dev.seaweedfs import DEV_ACCESS_KEY, DEV_SECRET_KEY

    _print(
        types.SimpleNamespace(
            endpoint_url="http://127.0.0.1:1", access_key=DEV_ACCESS_KEY, secret_key=DEV_SECRET_KEY, pid=7
        )
    )
    assert capsys.readouterr().out.splitlines()[:3] == [  # lines a shell runs as printed
        "export AWS_ENDPOINT_URL=http://127.0.0.1:1",
        f"export AWS_ACCESS_KEY_ID={DEV_ACCESS_KEY}",
        f"export AWS_SECRET_ACCESS_KEY={DEV_SECRET_KEY}",
    ]
    _print(types.SimpleNamespace(endpoint_url="http://127.0.0.1:1", access_key="k", secret_key="mine-xyz", pid=7))
    out = capsys.readouterr().out
    assert "mine-xyz" not in out and "AWS_SECRET_ACCESS_KEY=" not in out and "export AWS_ACCESS_KEY_ID=k\n" in out
