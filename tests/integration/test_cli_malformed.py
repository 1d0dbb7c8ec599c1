"""Every CLI command over malformed inputs: exit 2, one line naming the row/part and field, no traceback.

Run in-process (`main(argv)`), against the real SeaweedFS; "S3 down" is a port nothing listens on.
`--debug` brings the traceback back.
"""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.cli import main
from eagle3_data.dev.processes import free_port
from eagle3_data.schemas import schema_for
from eagle3_data.storage import StageRef
from eagle3_data.storage.store import StageOrigin

GOOD = {"messages": [{"role": "user", "content": "hi"}]}
DEEP = "[" * 5000 + "]" * 5000
HOSTILE = [
    '{"messages": [{"role": "user", "content": "hi"}], "ignored": %s}' % DEEP,  # RecursionError before
    '{"messages": [{"role": "user", "content": "half an emoji \\ud83d"}]}',
]  # UnicodeEncodeError before


@pytest.fixture
def env(monkeypatch, s3_server, store, kimi_tokenizer_dir, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-test-not-a-real-key")
    monkeypatch.setenv("EAGLE3_JOURNAL_DIR", str(tmp_path / "journal"))
    monkeypatch.chdir(tmp_path)
    return {
        "store": store,
        "tok": str(kimi_tokenizer_dir),
        "tmp": tmp_path,
        "bucket": store.bucket,
        "down": f"http://127.0.0.1:{free_port()}",
    }


def _jsonl(path, rows) -> str:
    with open(path, "wb") as f:
        for r in rows:
            line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
            f.write(line + b"\n")
    return str(path)


def _parquet(path, table: pa.Table) -> str:
    pq.write_table(table, path)
    return str(path)


def _stage_with_part(store, ref: StageRef, table: pa.Table) -> str:
    """A complete stage whose one part does not match its manifest's schema (another tool wrote it)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    store.write_object(ref, "part-00000.parquet", data)
    store.write_manifest(
        ref,
        schema={"name": "generations", "version": 1},
        parts=[
            {
                "name": "part-00000.parquet",
                "rows": table.num_rows,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ],
        files=[],
        origin=StageOrigin(inputs=[], params={}),
        extra={},
    )
    return store.uri(ref).rstrip("/")


def _generations(**override) -> pa.Table:
    schema = schema_for("generations")
    row = {
        "sample_id": "s1",
        "dataset": "d",
        "messages": json.dumps(GOOD["messages"]),
        "prompt_ids": [1, 2],
        "output_ids": [3, 4],
        "source": "sglang",
        "status": "ok",
        "finish_reason": "stop",
    }
    table = pa.Table.from_pylist([row], schema=schema)
    for name, value in override.items():
        if value is None:
            table = table.drop_columns([name])
        else:
            table = table.set_column(table.schema.get_field_index(name), name, value)
    return table


def _gen(e, prompts, *extra, bucket=None, endpoint=None):
    return [
        "generate",
        "overflow",
        "--dataset",
        "chat",
        "--prompts",
        prompts,
        "--run-key",
        "cli",
        "--overflow-fraction",
        "1",
        "--bucket",
        bucket or e["bucket"],
        "--tokenizer",
        e["tok"],
        "--base-url",
        "http://127.0.0.1:9/v1",
        *(["--endpoint-url", endpoint] if endpoint else []),
        *extra,
    ]


def _cases(e):
    t, store = e["tmp"], e["store"]
    bad_rows = [
        "{not json",
        {"no": "messages"},
        {"messages": "[]"},
        {"messages": [{"role": "bot", "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {**GOOD, "tools": [{"type": "function"}]},
    ]
    gen_ref = StageRef("cli", "generate_local", "chat")
    yield "generate: csv file", _gen(e, _jsonl(t / "p.csv", ["messages\nhi"])), ["p.csv", "unsupported file type"]
    yield "generate: empty file", _gen(e, _jsonl(t / "empty.jsonl", [])), ["0 usable prompt rows"]
    yield (
        "generate: every row malformed",
        _gen(e, _jsonl(t / "bad.jsonl", bad_rows)),
        ["6 of 6 rows rejected", "max_rejected_prompt_rate", "1 x row: not valid JSON", "line 1"],
    )
    yield (
        "generate: invalid UTF-8",
        _gen(e, _jsonl(t / "utf.jsonl", [b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'])),
        ["line 1", "invalid UTF-8"],
    )
    yield (
        "generate: parquet with wrong types",
        _gen(e, _parquet(t / "p.parquet", pa.table({"messages": [1, 2]}))),
        ["line 1", "messages: expected a list, got int"],
    )
    yield (
        "generate: oversize message",
        _gen(e, _jsonl(t / "big.jsonl", [{"messages": [{"role": "user", "content": "x" * 1_100_000}]}])),
        ["messages[0]", "limits.max_message_bytes"],
    )
    yield (
        "generate: unknown bucket",
        _gen(e, _jsonl(t / "ok.jsonl", [GOOD]), bucket="no-such-bucket-f13"),
        ["no-such-bucket-f13", "does not exist", "eagle3-data s3 init"],
    )
    yield "generate: S3 down", _gen(e, _jsonl(t / "ok2.jsonl", [GOOD]), endpoint=e["down"]), ["unreachable"]
    yield (
        "reconstruct: not parquet",
        [
            "reconstruct",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "x.parquet", [GOOD]),
            "--out",
            str(t / "o.jsonl"),
        ],
        ["x.parquet"],
    )
    yield (
        "reconstruct: wrong types",
        [
            "reconstruct",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "r.jsonl", [{"sample_id": 1, "content": 5, "finish_reason": "stop"}]),
            "--out",
            str(t / "o.jsonl"),
        ],
        ["line 1"],
    )
    yield (
        "reconstruct: lone surrogate",
        [
            "reconstruct",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "rs.jsonl", ['{"sample_id": "a", "content": "x\\ud800", "finish_reason": "stop"}']),
            "--out",
            str(t / "o.jsonl"),
        ],
        ["line 1", "'content'", "lone surrogate"],
    )
    yield (
        "reconstruct: nested too deep",
        [
            "reconstruct",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "rd.jsonl", ['{"sample_id": "a", "x": %s}' % DEEP]),
            "--out",
            str(t / "o.jsonl"),
        ],
        ["line 1", "nested deeper than 100 levels"],
    )
    yield (
        "validate: nested too deep",
        [
            "validate",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "vd.jsonl", ['{"sample_id": "a", "output_ids": [1], "p": {"q": %s}}' % ("[" * 200 + "]" * 200)]),
            "--report",
            str(t / "repd.json"),
            "--workers",
            "1",
        ],
        ["line 1", "p.q", "nested deeper"],
    )
    yield (
        "validate: out-of-range ids",
        [
            "validate",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "v.jsonl", [{"sample_id": "a", "output_ids": [10**9]}]),
            "--report",
            str(t / "rep.json"),
            "--workers",
            "1",
        ],
        ["line 1", "output_ids"],
    )
    yield (
        "validate: ids as strings",
        [
            "validate",
            "--thinking",
            "--tokenizer",
            e["tok"],
            "--input",
            _jsonl(t / "v2.jsonl", [{"sample_id": "a", "output_ids": ["1", "2"]}]),
            "--report",
            str(t / "rep2.json"),
            "--workers",
            "1",
        ],
        ["line 1", "output_ids"],
    )
    yield (
        "merge: unknown bucket",
        ["merge", "--input", "s3://no-such-bucket-f13/p/runs/r/generate_local/chat", "--out-run-key", "r"],
        ["no-such-bucket-f13", "eagle3-data s3 init"],
    )
    yield (
        "merge: S3 down",
        [
            "merge",
            "--input",
            f"s3://{e['bucket']}/p/runs/r/generate_local/chat",
            "--out-run-key",
            "r",
            "--endpoint-url",
            e["down"],
        ],
        ["unreachable"],
    )
    mistyped = _stage_with_part(store, gen_ref, _generations(output_ids=pa.array([["3", "4"]], pa.list_(pa.string()))))
    yield (
        "merge: ids as strings",
        ["merge", "--input", mistyped, "--out-run-key", "cli"],
        ["part-00000.parquet", "output_ids", "list<element: string>"],
    )
    missing = _stage_with_part(store, StageRef("cli", "generate_overflow", "chat"), _generations(usage=None))
    yield (
        "merge: part missing a column",
        ["merge", "--input", missing, "--out-run-key", "cli2"],
        ["part-00000.parquet", "'usage' is missing"],
    )
    yield "stage verify: mistyped part", ["stage", "verify", mistyped], ["part-00000.parquet", "output_ids"]
    yield (
        "stage verify: unknown bucket",
        ["stage", "verify", "s3://no-such-bucket-f13/runs/r/s/d"],
        ["eagle3-data s3 init"],
    )
    yield "stage verify: S3 down", ["stage", "verify", mistyped, "--endpoint-url", e["down"]], ["unreachable"]
    yield "stage discard: S3 down", ["stage", "discard", mistyped, "--endpoint-url", e["down"]], ["unreachable"]
    yield (
        "stage verify: not a stage URI",
        ["stage", "verify", "s3://b/x"],
        ["expected s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET"],
    )
    yield "s3 init: S3 down", ["s3", "init", "--bucket", "x-f13", "--endpoint-url", e["down"]], ["unreachable"]
    merged = schema_for("merged")
    yield (
        "extract: not parquet",
        ["extract", "--model", e["model"], "--input", _jsonl(t / "m.parquet", [GOOD]), "--out", str(t / "hs")],
        ["m.parquet", "not a readable Parquet file"],
    )
    yield (
        "extract: JSONL input",
        ["extract", "--model", e["model"], "--input", _jsonl(t / "m.jsonl", [GOOD]), "--out", str(t / "hs")],
        ["m.jsonl", ".parquet"],
    )
    yield (
        "extract: missing loss_mask",
        [
            "extract",
            "--model",
            e["model"],
            "--input",
            _parquet(t / "nl.parquet", pa.table({"sample_id": ["a"], "input_ids": [[1, 2]]})),
            "--out",
            str(t / "hs"),
        ],
        ["nl.parquet", "loss_mask"],
    )
    yield (
        "extract: ids as strings",
        [
            "extract",
            "--model",
            e["model"],
            "--input",
            _parquet(t / "st.parquet", pa.table({"sample_id": ["a"], "input_ids": [["1"]], "loss_mask": [[1]]})),
            "--out",
            str(t / "hs"),
        ],
        ["st.parquet", "input_ids"],
    )
    yield (
        "extract: out-of-range ids",
        [
            "extract",
            "--model",
            e["model"],
            "--input",
            _parquet(
                t / "oor.parquet",
                pa.Table.from_pylist(
                    [{"sample_id": "a", "source": "sglang", "input_ids": [1, 10**8], "loss_mask": [0, 1]}],
                    schema=merged,
                ),
            ),
            "--out",
            str(t / "hs"),
        ],
        ["oor.parquet", "row 1", "input_ids", "100000000"],
    )
    yield (
        "prompts upload: every row malformed",
        ["prompts", "upload", "--dataset", "chat", "--date", "2026-11-29", _jsonl(t / "up.jsonl", bad_rows)],
        ["6 bad row(s)", "up.jsonl"],
    )
    yield (
        "prompts upload: deep and surrogate rows",
        ["prompts", "upload", "--dataset", "chat", "--date", "2026-11-29", _jsonl(t / "up3.jsonl", [GOOD, *HOSTILE])],
        ["2 bad row(s)", "up3.jsonl"],
    )
    yield (
        "prompts upload: S3 down",
        [
            "prompts",
            "upload",
            "--dataset",
            "chat",
            "--date",
            "2026-11-29",
            _jsonl(t / "up2.jsonl", [GOOD]),
            "--endpoint-url",
            e["down"],
        ],
        ["unreachable"],
    )
    yield "prompts list: S3 down", ["prompts", "list", "--endpoint-url", e["down"]], ["unreachable"]
    ours = yaml.safe_load((files("eagle3_data") / "defaults" / "pipeline.yaml").read_text())
    ours["storage"]["bucket"] = e["bucket"]
    (t / "ours.yaml").write_text(yaml.safe_dump(ours))
    yield (
        "report: a run never published",
        ["report", "--run-key", "never-published", "--config", str(t / "ours.yaml")],
        ["run never-published has no report", "eagle3-data publish --run-key never-published"],
    )
    yield "report: S3 down", ["report", "--run-key", "r", "--endpoint-url", e["down"]], ["unreachable"]
    yield (
        "export-specforge: no shards",
        ["export-specforge", "--input", str(t), "--out", str(t / "sf")],
        ["no .safetensors"],
    )
    yield (
        "export-specforge: unknown bucket",
        ["export-specforge", "--input", "s3://no-such-bucket-f13/runs/r/extract/all", "--out", str(t / "sf")],
        ["eagle3-data s3 init"],
    )
    yield (
        "config check: unknown key",
        ["config", "check", _jsonl(t / "c.yaml", ["storage:", "  buckett: x"])],
        ["config"],
    )
    # a wrong special id is bad config whichever command meets it: exit 2 (it used to be 1 in generate)
    wrong = yaml.safe_load((files("eagle3_data") / "defaults" / "pipeline.yaml").read_text())
    wrong["tokenizer"].setdefault("expected_special_ids", {})["<|im_end|>"] = 163533
    (t / "wrong-id.yaml").write_text(yaml.safe_dump(wrong))
    yield (
        "generate: wrong special id",
        _gen(e, _jsonl(t / "ok3.jsonl", [GOOD]), "--config", str(t / "wrong-id.yaml")),
        ["tokenizer audit failed", "<|im_end|>", "163533"],
    )
    yield (
        "tokenizer audit: wrong special id",
        ["tokenizer", "audit", "--tokenizer", e["tok"], "--expect", "<|im_end|>=163533"],
        ["tokenizer audit failed", "<|im_end|>", "163533"],
    )
    yield "tokenizer audit: not a directory", ["tokenizer", "audit", "--tokenizer", str(t / "nope")], ["nope"]


def test_every_command_refuses_malformed_input_in_one_line(env, tiny_kimi_k25_dir, capsys):
    env["model"] = str(tiny_kimi_k25_dir)  # the default target (its vocabulary is under text_config)
    failures = []
    for name, argv, expected in _cases(env):
        code = main(argv)
        _out, err = capsys.readouterr()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        problems = []
        if code != 2:
            problems.append(f"exit {code}")
        if "Traceback" in err:
            problems.append("traceback")
        if not last.startswith("eagle3-data: error: "):
            problems.append(f"last line {last[:200]!r}")
        problems += [f"missing {s!r}" for s in expected if s not in last]
        if problems:
            failures.append(f"{name}: {'; '.join(problems)}\n    {last[:400]}")
    assert not failures, "\n".join(failures)


def _one_line_error(argv, capsys) -> str:
    """The error line of a command that must exit 2 without a traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("eagle3-data: error: "), last
    return last.removeprefix("eagle3-data: error: ")


def test_a_scheme_less_endpoint_is_named_with_the_fix(monkeypatch, capsys):
    """Issue 55: AWS_ENDPOINT_URL=127.0.0.1:8333 ended in boto's "Invalid endpoint" traceback, exit 1."""
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:8333")
    for argv in (["s3", "init", "--bucket", "x-f55"], ["stage", "verify", "s3://b/runs/r/s/d"]):
        last = _one_line_error(argv, capsys)
        assert last == "AWS_ENDPOINT_URL '127.0.0.1:8333' has no scheme: use http://127.0.0.1:8333"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "localhost:9")  # the S3-specific one wins, and is named
    assert _one_line_error(["s3", "init", "--bucket", "x-f55"], capsys).startswith("AWS_ENDPOINT_URL_S3 'localhost:9'")
    argv = ["s3", "init", "--bucket", "x-f55", "--endpoint-url", "ftp://h:1"]
    assert _one_line_error(argv, capsys) == "S3 endpoint 'ftp://h:1': the scheme must be http:// or https://"


def test_a_missing_prompts_file_says_no_such_file(env, capsys):
    """Issue 55: a prompts file that is not there got a paragraph about date partitions."""
    gone = env["tmp"] / "gone.jsonl"
    assert _one_line_error(_gen(env, str(gone)), capsys) == f"prompts file {gone}: no such file (dataset chat)"


def test_extract_names_the_merge_columns_a_parquet_lacks(env, tiny_kimi_k25_dir, capsys):
    """Issue 55: a parquet with input_ids and loss_mask but not the other columns extraction reads
    passed the input check and ended in Arrow's "No match for FieldRef.Name(source)"."""
    path = _parquet(
        env["tmp"] / "cols.parquet",
        pa.table(
            {
                "sample_id": ["a"],
                "input_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                "loss_mask": pa.array([[0, 1]], pa.list_(pa.uint8())),
            }
        ),
    )
    argv = ["extract", "--model", str(tiny_kimi_k25_dir), "--input", path, "--out", str(env["tmp"] / "hs")]
    last = _one_line_error(argv, capsys)
    assert last.startswith(f"--input {path}: missing column(s) source, prompt_tokens, provenance (a merge stage's")
    assert "FieldRef" not in last


def test_debug_shows_the_traceback(env, capsys):
    argv = _gen(env, _jsonl(env["tmp"] / "ok.jsonl", [GOOD]), bucket="no-such-bucket-f13")
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("eagle3-data: error: ")


def test_generate_rejects_are_printed_written_and_inputs_recorded(
    env, start_dev_server, kimi_tokenizer, capsys, monkeypatch
):
    server = start_dev_server({})
    bad = [
        "{oops",
        {"messages": [{"role": "bot", "content": "x"}]},
        {"messages": [{"role": "bot", "content": "y"}]},
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        *HOSTILE,
    ]
    path = _jsonl(env["tmp"] / "mixed.jsonl", [GOOD, *bad, {"messages": [{"role": "user", "content": "two"}]}])
    argv = [*_gen(env, path), "--base-url", server.url + "/v1", "--concurrency", "2"]
    store, ref, prompts = env["store"], StageRef("cli", "generate_overflow", "chat"), StageRef("cli", "prompts", "chat")
    # 6 of 8 rows rejected is over validation.max_rejected_prompt_rate (default 1%): bad input, exit 2
    # at load + route, one line counting each kind, the rejects left to read, nothing committed or sent
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last.startswith("eagle3-data: error: dataset chat: prompts ")
        and "6 of 8 rows rejected (75.00%), over validation.max_rejected_prompt_rate 1.00%: 2 x messages[].role: "
        in last
    ), last
    assert "; 1 x row: not valid JSON" in last and f"rejects: {store.uri(prompts, 'rejects.parquet')}" in last
    assert len(pq.read_table(pa.BufferReader(store.get_bytes(prompts, "rejects.parquet")))) == 6
    assert not store.is_complete(prompts) and not server.stats()["requests"].get("chat")
    lenient = yaml.safe_load((files("eagle3_data") / "defaults" / "pipeline.yaml").read_text())
    lenient["validation"]["max_rejected_prompt_rate"] = 0.75  # at the threshold passes
    (env["tmp"] / "lenient.yaml").write_text(yaml.safe_dump(lenient))
    monkeypatch.setenv("EAGLE3_CONFIG", str(env["tmp"] / "lenient.yaml"))
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert '"rows": 2,' in out  # the stage's rows as its manifest counts them (was null)
    assert "REJECTED 6 of 8 prompt rows" in err
    assert "2 x messages[].role" in err and "line 3: messages[0].role: 'bot'" in err and "invalid UTF-8" in err
    assert (
        "line 6: nested deeper than 100 levels" in err and "line 7: messages[0].content: holds a lone surrogate" in err
    )
    # the DAG's layout: the prompts stage (its source, its rows' sha256, rejects.parquet) feeds generation
    assert store.read_manifest(ref)["inputs"] == [store.input_record(prompts)]
    assert store.read_manifest(prompts)["params"]["source"] == path
    rejects = pq.read_table(pa.BufferReader(store.get_bytes(prompts, "rejects.parquet"))).to_pylist()
    assert sorted(r["line"] for r in rejects) == [2, 3, 4, 5, 6, 7]
    assert {r["field"] for r in rejects} == {"", "messages[0].role", "messages[0].content"}
    assert sum(server.stats()["requests"]["chat"].values()) == 2  # only the two good rows were sent
    # the same command again reuses the stage; another prompt file under the same run key is refused
    assert main(argv) == 0
    assert sum(server.stats()["requests"]["chat"].values()) == 2
    other = _jsonl(env["tmp"] / "other.jsonl", [{"messages": [{"role": "user", "content": "three"}]}])
    committed = store.read_manifest(prompts)
    assert main([*_gen(env, other), "--base-url", server.url + "/v1"]) == 2
    err = capsys.readouterr().err
    assert f'source "{path}" (committed) vs "{other}" (this run)' in err, err
    assert "--fresh prompts --fresh generate_overflow" in err, err
    assert store.read_manifest(prompts) == committed and store.is_complete(ref)  # the committed stages stay
    assert sum(server.stats()["requests"]["chat"].values()) == 2  # nothing sent for the other file
