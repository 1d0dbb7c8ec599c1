"""Memory of a trajectory stage's turn rounds (`conversations.TurnDriver`) and its samples file, against N.

    nice -n 19 .venv/bin/python benchmarks/conversation_memory.py                 # 1k, 10k, 50k conversations
    nice -n 19 .venv/bin/python benchmarks/conversation_memory.py --smoke         # 200, 1000: make test

What a `trajectory` / `regenerated` generation stage holds besides its requests: the prompts
(`checkpoint.parse_prompts`: spilled to disk, streamed each round), the driver (every turn row
observed, what the walk needs of it) and, at the end, `samples_file()`. Each N runs in its own
process (benchmarks/_harness.measure) with the real Kimi chat format. The answers are made up at
the engine's seam, each from its conversation's seed (so the benchmark itself holds nothing per
conversation): turn 1 calls the conversation's two recorded tools (~2 KB of reasoning, ~500
output ids), the driver splices the recorded results, turn 2 answers (~1.5 KB); each turn's
`prompt_ids` is the one before it + its answer's ids + the tool results' ids, as the engine
would have been given. Figures per N: RSS after the rounds (the driver's), the samples file's
own peak above that (VmHWM reset before it, `/proc/self/clear_refs`), and MiB per 1k samples,
for `samples_file` (a batch of rows at a time) and `previous` (the former one: every row in one
list and one table), each N and variant in a fresh process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import REPO, measure, slope, table

SETUP = """
import json
import numpy as np
from transformers import AutoTokenizer
from eagle3_data.chat_format import get_output_format
from eagle3_data.stages.generate.checkpoint import parse_prompts
from eagle3_data.conversations import TurnDriver, read_samples

FMT = get_output_format(AutoTokenizer.from_pretrained({tokenizer!r}), thinking=True)
STOP = FMT.stop_token_ids[0]
TOOLS = [{{"type": "function", "function": {{"name": "lookup", "parameters": {{"type": "object"}}}}}}]


def calls(i):
    return [
        {{"id": f"c{{k}}", "type": "function",
          "function": {{"name": "lookup", "arguments": json.dumps({{"q": f"item {{i}}-{{k}}"}})}}}}
        for k in range(2)
    ]


def conversations(n):
    for i in range(n):
        yield {{"sample_id": f"conv{{i}}", "tools": TOOLS, "messages": [
            {{"role": "system", "content": "You look things up."}},
            {{"role": "user", "content": f"Question {{i}}: " + "x" * 200}},
            {{"role": "assistant", "content": "", "tool_calls": calls(i)}},
            *({{"role": "tool", "tool_call_id": c["id"], "content": "result " + "y" * 300}} for c in calls(i)),
            {{"role": "assistant", "content": "done"}},
        ]}}


def ids(seed, n):
    return np.random.default_rng(seed).integers(0, 163_000, n).tolist()


def answer(row):
    \"\"\"The engine's answer to one prompt row: turn 1 (the prompt ends with the user) calls the
    recorded tools, turn 2 (it ends with their results) answers.\"\"\"
    messages = json.loads(row["messages"])
    i = int(messages[1]["content"].split(":")[0].split()[1])
    first = ids(i, 300)  # turn 1's prompt
    out1 = ids(10**9 + i, 500)
    if messages[-1]["role"] == "user":
        return {{"sample_id": row["sample_id"], "status": "ok", "finish_reason": "tool_calls", "content": "",
                "reasoning": "r" * 2000, "tool_calls": calls(i), "output_ids": out1 + [STOP], "prompt_ids": first}}
    prompt = first + out1 + [STOP] + ids(2 * 10**9 + i, 200)
    return {{"sample_id": row["sample_id"], "status": "ok", "finish_reason": "stop", "content": "a" * 1000,
            "reasoning": "r" * 500, "tool_calls": None, "output_ids": ids(3 * 10**9 + i, 300) + [STOP],
            "prompt_ids": prompt}}


def previous(driver):
    # the former `samples_file`: every sample's row as a dict in one list, one table, one write
    import io
    import pyarrow as pa
    import pyarrow.parquet as pq
    from eagle3_data.conversations import SAMPLES, Tally

    rows = list(driver.sample_rows())
    buf, tally = io.BytesIO(), Tally()
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLES), buf)
    tally.add(rows)
    return buf.getvalue(), tally.figures(driver.tag)


def rss(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 1024
"""

WORK = """
driver = TurnDriver("trajectory", "regenerated", FMT)
driver.start(parse_prompts(conversations({n}), "bench", None))
rounds = 0
while rows := driver.next_prompts():
    rounds += 1
    for row in rows:
        driver.observe(answer(row))
after_rounds = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the samples file's own peak next
data, figures = {call}
file_peak = rss("VmHWM:") - after_rounds  # before the checks below read the file back
samples = read_samples(data)
assert len(samples) == {n} and all(len(s["steps"]) == 2 and s["end"] == "answered" for s in samples), figures
assert figures["exact_turns"] == {n} and figures["not_prefix"] == 0, figures
RESULT = {{"rounds": rounds, "after_rounds": after_rounds, "file_peak": file_peak,
          "file_bytes": len(data), "samples": len(samples)}}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 50000])
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="the Kimi tokenizer's folder (default: built in .cache)"
    )
    p.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.sizes = [200, 1000]
    if args.tokenizer is None:
        from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer

        args.tokenizer = cached_kimi_tokenizer(REPO / ".cache")
    rows = []
    for n in args.sizes:
        for variant, call in (("samples_file", "driver.samples_file()"), ("previous", "previous(driver)")):
            r = measure(SETUP.format(tokenizer=str(args.tokenizer)), WORK.format(n=n, call=call))
            res = r["result"]
            rows.append(
                {
                    "variant": variant,
                    "n": n,
                    "rounds": res["rounds"],
                    "work_s": r["work_s"],
                    "after_rounds": res["after_rounds"],
                    "file_peak": res["file_peak"],
                    "file_kib": res["file_bytes"] / 1024,
                    "peak": r["peak_rss_mib"],
                }
            )
            print(
                f"{variant:12s} N={n:6d}: {r['work_s']:.1f} s, RSS after the rounds {res['after_rounds']:.0f} MiB, "
                f"samples file +{res['file_peak']:.0f} MiB",
                flush=True,
            )
    print(
        table(
            rows,
            [
                ("variant", "samples file"),
                ("n", "conversations"),
                ("rounds", "rounds"),
                ("work_s", "work s"),
                ("after_rounds", "RSS after the rounds MiB"),
                ("file_peak", "samples file's peak above it MiB"),
                ("file_kib", "samples file KiB"),
                ("peak", "process peak MiB"),
            ],
        )
    )
    ours = [r for r in rows if r["variant"] == "samples_file"]
    driver = slope([(r["n"] / 1000, r["after_rounds"]) for r in ours])
    print(f"RATIO conversation_memory driver slope = {driver:.2f} MiB per 1k conversations")
    for variant in ("samples_file", "previous"):
        pts = [(r["n"] / 1000, r["file_peak"]) for r in rows if r["variant"] == variant]
        print(
            f"RATIO conversation_memory {variant} peak slope = {slope(pts):.2f} MiB per 1k "
            f"({pts[0][1]:.1f} -> {pts[-1][1]:.1f} MiB from {pts[0][0]:g}k to {pts[-1][0]:g}k)"
        )


if __name__ == "__main__":
    main()
