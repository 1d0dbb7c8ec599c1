"""The plan (issue 57): `eagle3-data plan` and the DAG's dry run give the same plan; its figures
are checked against numbers made here (the prompts' tokens rendered by the tokenizer, the bytes
per token by hand); a stand-in's earlier run is never a source; the report tab shows it."""

from __future__ import annotations

import json
import math

import yaml

from eagle3_data.config import default_config_raw, load_config
from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_data.storage.writer import StageWriter

N = 40


def write_config(tmp_path, kimi_tokenizer_dir, store, **plan) -> str:
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {i}" + " more" * (i % 7)}]}) + "\n"
            for i in range(N)
        )
    )
    raw = default_config_raw()
    raw["storage"] = {"bucket": store.bucket, "prefix": store.prefix}
    raw["tokenizer"]["source"] = str(kimi_tokenizer_dir)
    raw["datasets"] = [{"name": "chat", "prompts": str(prompts)}]
    raw["generation"]["overflow"]["max_usd"] = 0.01
    raw["routing"]["overflow_fraction"] = 0.5
    raw["plan"] = plan
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def dry_run(config_path: str, run_key: str = "dry"):
    from eagle3_data.runs.run import Run

    config = load_config(config_path)
    return Run(config=config, run_key=run_key, date=None, datasets=["chat"], dry_run=True, skip_hidden_states=False)


def test_cli_plan_equals_the_dry_runs_and_its_figures_hold(store, kimi_tokenizer_dir, kimi_tokenizer, tmp_path, capsys):
    from eagle3_data import pipeline
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.cli import main
    from eagle3_data.report.plan_view import load_plan, render_plan_html

    config_path = write_config(tmp_path, kimi_tokenizer_dir, store, expected_output_tokens=300)
    run = dry_run(config_path)
    pipeline.load_route(run, store, "chat")
    result = pipeline.publish(run, store)  # the DAG's publish of a dry run: the run's plan
    uri, stored = load_plan(store, "dry")
    assert result.report_uri == uri

    assert main(["plan", "--config", config_path, "--run-key", "dry", "--offline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == stored  # the same plan, figure for figure

    # prompt tokens as the tokenizer renders them, here; every other figure from them by hand
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    prompt = [
        len(fmt.generation_prompt_ids([{"role": "user", "content": f"question {i}" + " more" * (i % 7)}]))
        for i in range(N)
    ]
    t = stored["totals"]
    assert t["merged_tokens"] == {"expected": sum(prompt) + N * 300, "upper": sum(prompt) + N * 2048}
    bf16 = 2 * 4 * 7168 + 4 + 1 + 4  # 3 aux + last at Kimi-K2.5's width (the model is a stand-in), ids, mask, logprob
    storage = stored["storage"]
    assert storage["hidden_size"] == 7168 and "stand-in" in storage["hidden_size_source"]
    assert storage["dtypes"]["bf16"] == {"bytes_per_token": bf16, "expected": bf16 * (sum(prompt) + N * 300)} | {
        "upper": bf16 * (sum(prompt) + N * 2048)
    }
    assert storage["dtypes"]["ids-only"]["bytes_per_token"] == 5
    assert stored["extraction"]["gpu_hours"]["upper"] == round((sum(prompt) + N * 2048) / 4000 / 3600, 6)

    (chat,) = stored["datasets"].values()
    e = chat["estimate"]
    overflow = e["samples"]["overflow"]
    assert overflow == chat["counts"].get("overflow", 0) + chat["counts"].get("both", 0) > 0
    upper = (e["prompt_tokens_by_side"]["overflow"] * 0.60 + overflow * 2048 * 2.50) / 1e6
    expected = (e["prompt_tokens_by_side"]["overflow"] * 0.60 + overflow * 300 * 2.50) / 1e6
    assert e["usd"]["upper"] == round(upper, 6) and e["usd"]["expected"] == round(expected, 6)
    assert e["output_tokens"]["source"] == "config plan.expected_output_tokens"
    fit = math.floor(0.01 / (upper / overflow))
    (warning,) = stored["warnings"]
    assert "generation.overflow.max_usd 0.01" in warning and f"{fit:,} of {overflow:,} overflow samples" in warning

    capsys.readouterr()
    assert main(["plan", "--config", config_path, "--run-key", "dry", "--offline"]) == 0
    table = capsys.readouterr().out
    assert len(table.splitlines()) <= 25 and "WARNING: dataset chat" in table and "GPU-hours" in table
    html = render_plan_html(stored, uri, title="plan <x>")
    assert "max_usd 0.01" in html and "plan &lt;x&gt;" in html and "bf16" in html


def test_earlier_runs_on_a_stand_in_are_never_a_source(store, kimi_tokenizer_dir, tmp_path):
    """The dev server's 0.09 s a sample (an earlier demo) must not plan a Kimi-K2.5 run; a real
    engine's earlier run gives the latency and the expected answer length (its mean)."""
    from eagle3_data import pipeline

    config_path = write_config(tmp_path, kimi_tokenizer_dir, store)
    dev = ArtifactStore(store.client, store.bucket, store.prefix, stand_ins=("tokenizer", "model", "local_engine"))
    rows = [
        {"sample_id": f"s{i}", "dataset": "chat", "status": "ok", "usage": {"completion_tokens": n}}
        for i, n in enumerate((100, 300))
    ]
    for st, key, n, latency in ((store, "real", None, 30.0), (dev, "demo", 7, 0.09)):  # the stand-in's newest
        with StageWriter(st, StageRef(key, "generate_local", "chat"), "generations", rows_per_part=8) as w:
            w.write([r if n is None else {**r, "usage": {"completion_tokens": n}} for r in rows])
            w.commit(extra={"latency_s_mean": latency, "in_flight": {"http://a": 64}})
    e = pipeline.load_route(dry_run(config_path, "next"), store, "chat", write_plan=False).plan["estimate"]
    real = store.uri(StageRef("real", "generate_local", "chat"))
    assert e["rate_inputs"]["local"]["source"] == real and e["rate_inputs"]["local"]["latency_s"] == 30.0
    assert e["output_tokens"]["per_sample"] == 200 and real in e["output_tokens"]["source"]
    assert e["stand_in_runs_skipped"] == 1


def test_forked_prompt_counts_equal_the_serial_ones(kimi_tokenizer, monkeypatch):
    """A large load renders its prompts on forked workers: the same counts, rejects and order."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.stages.prompts import load as prompts_mod

    fmt = get_output_format(kimi_tokenizer, thinking=True)
    lines = [json.dumps({"messages": [{"role": "user", "content": "word " * (i % 50) + str(i)}]}) for i in range(300)]

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.jsonl"
        path.write_text("\n".join(lines) + "\n")
        results = []
        for workers in (1, 2):
            monkeypatch.setattr(prompts_mod, "FORK_MIN_ROWS", 1 if workers > 1 else 10**9)
            loaded = prompts_mod.load_prompts(str(path), "chat", prompts_mod.PromptShape(sampling={}, repeats=1))
            counted: dict[str, int] = {}
            prompts_mod.limit_prompt_tokens(
                loaded,
                40,
                lambda m, t, images=None: len(fmt.generation_prompt_ids(m, t)),
                counted,
                workers=workers,
            )
            results.append((counted, [r["line"] for r in loaded.rejects], len(loaded.rows)))
    assert results[0] == results[1] and results[0][1]  # some prompts over 40 tokens were refused alike
