"""Validation throughput (whole `eagle3-data validate` command, startup included) against raw
tiktoken decode + encode of the same ids, measured in the same run; peak RSS at two input sizes.

    .venv/bin/python benchmarks/validate_throughput.py --tokenizer DIR [--tokens 9000000] [--small 1000000]

Input: synthetic local generations rendered from the Python standard library's source text
(deterministic), ~1,100 tokens per sample: reasoning, content, some with tool calls.

The gate's prompt-side billing check (issue 33) runs in the pipeline's validate stage, not in the
file mode this command times: it is timed apart, in the same interleaved pairs, over the same rows
written as an overflow stage in a fresh SeaweedFS (prompt ids a quarter of each row), and added to
the command's wall time for the `with the prompt billing check` ratio. The log-probability check
(issue 29) does not exist yet.

    .venv/bin/python benchmarks/validate_throughput.py --tokenizer DIR --smoke    # make test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def kimi_encoding(tokenizer_dir: Path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from eagle3_data.chat_format.kimi_k2 import KIMI_PATTERN

    ranks = load_tiktoken_bpe(str(tokenizer_dir / "tiktoken.model"))
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    specials = {t["content"]: t["id"] for t in added}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def corpus() -> str:
    root = Path(json.__file__).resolve().parent.parent  # the stdlib
    texts = []
    for path in sorted(root.glob("*.py")):
        texts.append(path.read_text(errors="replace"))
    return "".join(texts)


def write_input(enc, path: Path, target_tokens: int) -> tuple[int, int]:
    text = corpus()
    pos = samples = tokens = 0
    with open(path, "w") as fh:
        while tokens < target_tokens:
            chunk = text[pos : pos + 4000]
            pos = (pos + 4000) % (len(text) - 4000)
            reasoning, content = chunk[:2800], chunk[2800:]
            gen = f"{reasoning}</think>{content}"
            if samples % 5 == 0:
                gen += (
                    "<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>"
                    + json.dumps({"code": chunk[:200]})
                    + "<|tool_call_end|><|tool_calls_section_end|>"
                )
            finish = "length" if samples % 7 == 0 else "stop"
            ids = enc.encode(gen + ("<|im_end|>" if finish == "stop" else ""), allowed_special="all")
            fh.write(json.dumps({"sample_id": f"s{samples}", "output_ids": ids, "finish_reason": finish}) + "\n")
            samples += 1
            tokens += len(ids)
    return samples, tokens


def raw_rate(enc, path: Path) -> tuple[float, float]:
    """tokens/s of wall time and of CPU time, decode + encode only (ids already in memory)."""
    with open(path) as lines:
        rows = [json.loads(line)["output_ids"] for line in lines]
    tokens = sum(map(len, rows))
    start, cpu = time.perf_counter(), time.process_time()
    for ids in rows:
        enc.encode(enc.decode_bytes(ids).decode("utf-8", "replace"), allowed_special="all")
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def run_validate(tokenizer_dir: Path, path: Path, report: Path) -> tuple[float, int, int, float]:
    """Wall seconds, exit code, peak RSS (KiB, largest process) and CPU seconds (all its
    processes) of one `eagle3-data validate` command."""
    cmd = [
        str(REPO / ".venv/bin/eagle3-data"),
        "validate",
        "--tokenizer",
        str(tokenizer_dir),
        "--thinking",
        "--input",
        str(path),
        "--report",
        str(report),
    ]
    start = time.perf_counter()
    pid = os.posix_spawn(cmd[0], cmd, os.environ)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    return wall, os.waitstatus_to_exitcode(status), usage.ru_maxrss, usage.ru_utime + usage.ru_stime


def billing_stage(path: Path):
    """The rows of `path` as an overflow reconstruct stage in a fresh SeaweedFS (prompt ids a quarter
    of each row's length, `usage.prompt_tokens` equal to them, as the provider bills), for the
    gate's prompt-side billing check (stages/validate/stage.py `_prompt_billing_rows` +
    `compare_billed_prompts`): a context manager yielding (store, ref, rows)."""
    import contextlib

    import numpy as np
    import pyarrow as pa

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import seaweedfs, store_for

    from eagle3_data.schemas import GENERATIONS
    from eagle3_data.storage import StageRef
    from eagle3_data.storage.writer import StageWriter

    @contextlib.contextmanager
    def stage():
        with seaweedfs() as (handle, _):
            store = store_for(handle, "bench")
            ref = StageRef("bench", "reconstruct", "d")
            rng = np.random.default_rng(0)
            rows = 0
            with StageWriter(
                store, ref, "generations", rows_per_part=1024, tokenizer_sha256="t", template_sha256="t"
            ) as w:
                lines = path.read_text().splitlines()
                for start in range(0, len(lines), 2048):
                    chunk = [json.loads(x) for x in lines[start : start + 2048]]
                    n = len(chunk)
                    prompts = [rng.integers(0, 163_840, max(1, len(r["output_ids"]) // 4)).tolist() for r in chunk]
                    cols = {
                        "sample_id": pa.array([r["sample_id"] for r in chunk]),
                        "dataset": pa.array(["d"] * n),
                        "messages": pa.array(["[]"] * n),
                        "prompt_ids": pa.array(prompts),
                        "output_ids": pa.array([r["output_ids"] for r in chunk]),
                        "source": pa.array(["openrouter"] * n),
                        "status": pa.array(["ok"] * n),
                        "finish_reason": pa.array(["stop"] * n),
                        "usage": pa.array(
                            [
                                {
                                    "prompt_tokens": len(p),
                                    "completion_tokens": len(r["output_ids"]),
                                    "reasoning_tokens": 0,
                                    "cost_usd": 1e-6,
                                }
                                for p, r in zip(prompts, chunk)
                            ]
                        ),
                    }
                    w.write(
                        pa.Table.from_arrays(
                            [cols[f.name].cast(f.type) if f.name in cols else pa.nulls(n, f.type) for f in GENERATIONS],
                            schema=GENERATIONS,
                        )
                    )
                    rows += n
                w.commit()
            yield store, ref, rows

    return stage()


def billing_seconds(store, ref) -> tuple[float, dict]:
    from eagle3_data.stages.validate.billing import compare_billed_prompts
    from eagle3_data.stages.validate.stage import _prompt_billing_rows

    t = time.perf_counter()
    report = compare_billed_prompts(_prompt_billing_rows(store, ref))
    return time.perf_counter() - t, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=9_000_000)
    ap.add_argument("--small", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs; best of each is reported")
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.small, args.repeat = 100_000, 30_000, 1
    enc = kimi_encoding(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big.jsonl", Path(tmp) / "small.jsonl"
        n_big, t_big = write_input(enc, big, args.tokens)
        n_small, t_small = write_input(enc, small, args.small)
        print(f"inputs: {n_big} samples / {t_big} tokens ({big.stat().st_size >> 20} MiB); {n_small} / {t_small}")
        cold, *_ = run_validate(
            args.tokenizer, small, Path(tmp) / "cold.json"
        )  # fills the verified-codec cache if empty
        raws, walls, ratios, cpu_ratios, bills, gated = [], [], [], [], [], []
        with billing_stage(big) as (store, ref, billed_rows):
            for _ in range(args.repeat):  # interleaved: a noisy shared machine hits both sides alike
                raw, raw_cpu = raw_rate(enc, big)
                wall, rc, rss_big, cpu = run_validate(args.tokenizer, big, Path(tmp) / "big.json")
                bill, bill_report = billing_seconds(store, ref)
                raws.append(raw)
                walls.append(wall)
                bills.append(bill)
                ratios.append(t_big / wall / raw)
                gated.append(t_big / (wall + bill) / raw)  # the stage runs the round trip, then the billing pass
                cpu_ratios.append(t_big / cpu / raw_cpu)
        _, _, rss_small, _ = run_validate(args.tokenizer, small, Path(tmp) / "small.json")
        report = json.loads((Path(tmp) / "big.json").read_text())
        print(f"first run on the small input (may verify tiktoken against HF): {cold:.2f} s")
        print(
            f"raw tiktoken decode+encode (1 thread, no I/O): best {max(raws) / 1e6:.2f} M tokens/s; all "
            f"{[round(r / 1e6, 2) for r in raws]}"
        )
        print(
            f"eagle3-data validate (whole command, startup included): best {min(walls):.2f} s = "
            f"{t_big / min(walls) / 1e6:.2f} M tokens/s; "
            f"all {[round(w, 2) for w in walls]} s; exit {rc}; counts {report['counts']}"
        )
        print(
            f"ratio validate / raw, per interleaved pair: {[round(r, 2) for r in ratios]}; best-vs-best "
            f"{t_big / min(walls) / max(raws):.2f}"
        )
        print(
            f"prompt-side billing check (the stage's pass over {billed_rows} overflow rows in S3: Arrow lengths + "
            f"compare_billed_prompts): best {min(bills):.3f} s = {min(bills) * max(raws) / t_big:.4f} of the raw "
            f"decode+encode time; gate {'passed' if bill_report['gate']['passed'] else 'FAILED'}"
        )
        print(f"ratio (validate + prompt billing) / raw, per interleaved pair: {[round(r, 2) for r in gated]}")
        print(
            f"RATIO validate_throughput validate/raw = {max(ratios):.2f}, with the prompt billing check "
            f"{max(gated):.2f} (best pair)"
        )
        print(
            "CPU-time efficiency (raw CPU s / validate CPU s, all processes, startup included): "
            f"{[round(r, 2) for r in cpu_ratios]}"
        )
        print(
            f"peak RSS (largest process): {rss_small / 1024:.0f} MiB at {t_small} tokens, {rss_big / 1024:.0f} MiB "
            f"at {t_big} tokens"
        )
        print(f"cpus: {os.cpu_count()}, load average before: {os.getloadavg()}, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
