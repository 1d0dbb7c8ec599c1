"""Local generation on a real `vllm serve` (CPU, fp32, the tiny Kimi-K2.5): exact ids, stop ids,
resume after SIGKILL, and the gate on the engine's own output. One server per session (the one
the image prompts use too); the reference is transformers' `Kimi_K25ForConditionalGeneration`.

A random model almost never emits `<|im_end|>`, so the stop path is driven with a `logit_bias` on
it, sent by the client like any sampling parameter and applied identically to the transformers
reference: the bias is chosen from the reference's own logits so that some prompts stop on
`<|im_end|>` and others run to `max_new_tokens`, as far from every logit gap as possible
(margins of ~1e-3 against fp32 differences of ~1e-6).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eagle3_data.storage import StageRef
from tests.generation_calls import generate_vllm as generate_local

MAX_NEW = 24
IM_END = 163_586


def prompts(n: int, dataset: str = "chat") -> list[dict]:
    return [
        {
            "sample_id": f"v{i:04d}",
            "dataset": dataset,
            "sample_index": i,
            "route": "local",
            "messages": json.dumps([{"role": "user", "content": f"Question {i}: name a colour and a number."}]),
            "tools": None,
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def fmt(kimi_tokenizer):
    from eagle3_data.chat_format import get_output_format

    return get_output_format(kimi_tokenizer, thinking=True)


@pytest.fixture(scope="module")
def reference_model(tiny_kimi_k25_dir):
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_k25_dir), dtype=torch.float32).eval()


def greedy_with_gaps(model, prompt_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids over every token but <|im_end|> (KV cache, one token per step), and per step the
    gap between the best logit and <|im_end|>'s: with a bias b on <|im_end|>, greedy decoding
    follows these ids until the first step whose gap < b, and emits <|im_end|> there."""
    out, gaps = [], []
    with torch.no_grad():
        res = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            logits = res.logits[0, -1].clone()
            stop = float(logits[IM_END])
            logits[IM_END] = float("-inf")
            best = int(logits.argmax())
            gaps.append(float(logits[best]) - stop)
            out.append(best)
            res = model(torch.tensor([[best]]), cache=res.past_key_values, use_cache=True)
    return out, gaps


def biased(ids: list[int], gaps: list[float], bias: float) -> list[int]:
    stop = next((i for i, g in enumerate(gaps) if g < bias), None)
    return ids if stop is None else ids[:stop] + [IM_END]


def choose_bias(all_gaps: list[list[float]]) -> tuple[float, float]:
    """The <|im_end|> bias that makes at least one prompt stop after step 3 and one run to the
    limit, with the widest margin between the bias and every gap a prompt meets before it stops
    (a biased greedy run equals the unbiased one until the first step whose gap < bias)."""
    values = sorted({g for gaps in all_gaps for g in gaps})
    best = (0.0, -1.0)
    for lo, hi in itertools.pairwise(values):
        b = (lo + hi) / 2
        stops = [next((i for i, g in enumerate(gaps) if g < b), None) for gaps in all_gaps]
        if not any(s is not None and s >= 3 for s in stops) or all(s is not None for s in stops):
            continue
        margin = min(abs(g - b) for gaps, s in zip(all_gaps, stops) for g in gaps[: None if s is None else s + 1])
        best = max(best, (b, margin), key=lambda t: t[1])
    return best


def test_ids_equal_transformers_greedy_and_stop_id_is_kept(
    vllm_server, store, kimi_tokenizer, fmt, reference_model, tmp_path
):
    rows = prompts(6)
    prompt_ids = [fmt.generation_prompt_ids(json.loads(r["messages"]), None) for r in rows]
    runs = [greedy_with_gaps(reference_model, p, MAX_NEW) for p in prompt_ids]
    bias, margin = choose_bias([gaps for _, gaps in runs])
    assert margin > 1e-3, f"no bias separates stop and length runs by 1e-3 (best {margin}): model changed?"
    expected = [biased(ids, gaps, bias) for ids, gaps in runs]
    assert any(e[-1] == IM_END and len(e) > 3 for e in expected) and any(e[-1] != IM_END for e in expected)

    ref = StageRef(run_key="vllm-a", stage="generate_local", dataset="chat")
    sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "thinking": True, "logit_bias": {str(IM_END): bias}}
    summary = generate_local(
        store,
        ref,
        rows,
        kimi_tokenizer,
        [vllm_server.url],
        sampling,
        in_flight_per_endpoint=3,
        rows_per_part=4,
        model="tiny-kimi",
        journal_dir=tmp_path,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 6, summary
    table = {r["sample_id"]: r for r in store.read_table(ref).to_pylist()}
    for r, p_ids, want in zip(rows, prompt_ids, expected):
        got = table[r["sample_id"]]
        assert got["source"] == "vllm" and got["status"] == "ok"
        assert got["prompt_ids"] == p_ids
        assert got["output_ids"] == want, r["sample_id"]
        if want[-1] == IM_END:
            assert got["finish_reason"] == "stop" and got["output_ids"][-1] == IM_END  # stored WITH the stop id
            assert json.loads(got["provenance"])["finish_reason"]["matched"] == IM_END
        else:
            assert got["finish_reason"] == "length" and len(got["output_ids"]) == MAX_NEW
        assert got["usage"]["completion_tokens"] == len(want)
    assert sum(w[-1] == IM_END for w in expected) >= 1
    manifest = store.read_manifest(ref)
    assert manifest["params"]["source"] == "vllm" and manifest["extra"]["served_models"] == {
        vllm_server.url: "tiny-kimi"
    }


def test_the_gate_runs_on_the_engines_output(vllm_server, store, kimi_tokenizer, fmt, tmp_path):
    from eagle3_data.stages.validate import rows_from_batches, validate_to_report

    ref = StageRef(run_key="vllm-g", stage="generate_local", dataset="chat")
    sampling = {"temperature": 0.0, "max_new_tokens": 12, "thinking": True, "logit_bias": {str(IM_END): 40.0}}
    generate_local(store, ref, prompts(2), kimi_tokenizer, [vllm_server.url], dict(sampling), journal_dir=tmp_path)
    # half the rows with a huge bias (stop at once), half without (length): both stop kinds present
    ref2 = StageRef(run_key="vllm-g", stage="generate_local", dataset="chat2")
    generate_local(
        store,
        ref2,
        prompts(2, "chat2"),
        kimi_tokenizer,
        [vllm_server.url],
        {"temperature": 0.0, "max_new_tokens": 12, "thinking": True},
        journal_dir=tmp_path,
    )
    batches = list(store.iter_batches(ref)) + list(store.iter_batches(ref2))
    report = validate_to_report(fmt, lambda: rows_from_batches(batches, fmt.vocab_size))
    assert report["samples"] == 4 and not report["bad_rows"]
    stops = report["stop_convention"]
    assert stops["convention"] == "included" and stops["stop_rows"] == 2 and stops["matched_rows"] == 2
    assert report["counts"]["wrong_stop"] == 0 and report["counts"]["stop_string"] == 0
    assert sum(report["counts"].values()) == 4


CHILD = """
import json, sys
from tests.generation_calls import generate_vllm as generate_local
from eagle3_data.storage import ArtifactStore, StageRef, s3_client
from transformers import AutoTokenizer
a = json.loads(sys.argv[1])
store = ArtifactStore(client=s3_client(endpoint_url=a["endpoint"]), bucket=a["bucket"], prefix=a["prefix"])
tok = AutoTokenizer.from_pretrained(a["tokenizer"])
print(json.dumps(generate_local(store, StageRef(**a["ref"]), a["prompts"], tok, [a["url"]], a["sampling"],
      in_flight_per_endpoint=2, rows_per_part=4, journal_dir=a["journal"], flush_interval_s=0.5)))
"""


@pytest.mark.slow
def test_sigkill_mid_stage_then_resume_without_duplicates(
    vllm_server, store, s3_server, kimi_tokenizer, kimi_tokenizer_dir, tmp_path
):
    ref = StageRef(run_key="vllm-kill", stage="generate_local", dataset="chat")
    n = 24
    args = {
        "endpoint": s3_server.endpoint_url,
        "bucket": store.bucket,
        "prefix": store.prefix,
        "tokenizer": str(kimi_tokenizer_dir),
        "ref": {"run_key": ref.run_key, "stage": ref.stage, "dataset": ref.dataset},
        "prompts": prompts(n),
        "url": vllm_server.url,
        "journal": str(tmp_path / "journal"),
        "sampling": {"temperature": 0.0, "max_new_tokens": 16, "thinking": True},
    }
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        AWS_DEFAULT_REGION="us-east-1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def journaled() -> int:
        return sum(len(p.read_text().splitlines()) for p in (tmp_path / "journal").glob("*.jsonl"))

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        committed = len(store.committed_sample_ids(ref))
        if committed >= 4 and journaled() >= committed + 1:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    out = proc.communicate()[0]
    killed_at = len(store.committed_sample_ids(ref))
    assert 4 <= killed_at < n, out[-2000:]
    summary = generate_local(
        store,
        ref,
        prompts(n),
        kimi_tokenizer,
        [vllm_server.url],
        args["sampling"],
        in_flight_per_endpoint=2,
        rows_per_part=4,
        journal_dir=tmp_path / "journal",
    )
    assert summary["complete"] and summary["counts"]["replayed"] >= 1, summary
    rows = store.read_table(ref).to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)) == n and all(r["status"] == "ok" for r in rows)
    # greedy: an answer replayed from the journal equals what the engine gives for it now
    by_id = {r["sample_id"]: r for r in rows}
    again = StageRef(run_key="vllm-kill-check", stage="generate_local", dataset="chat")
    generate_local(store, again, prompts(3), kimi_tokenizer, [vllm_server.url], args["sampling"], journal_dir=tmp_path)
    for r in store.read_table(again).to_pylist():
        assert r["output_ids"] == by_id[r["sample_id"]]["output_ids"]


def test_the_dev_server_runs_its_worker_inside_the_engine_core(vllm_server):
    """eagle3_devtools.vllm_serve starts `vllm serve` without V1 multiprocessing, so the engine
    core runs its one worker itself ("uni" executor): no `VLLM::Worker` process, whose queue the
    core would spin on for as long as the worker computes (twice the CPU for the same wall on a
    2-core machine: benchmarks/vllm_extract.py). Read from /proc: the names
    vLLM gives its processes."""
    from pathlib import Path

    def descendants(pid: int) -> list[str]:
        names = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited while listed
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                names += [(stat.parent / "comm").read_text().strip(), *descendants(child)]
        return names

    names = descendants(vllm_server.proc.pid)
    assert any(n.startswith("VLLM::EngineCor") for n in names), names  # the process this is about, found
    assert not any(n.startswith("VLLM::Worker") for n in names), names
