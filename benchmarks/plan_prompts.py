"""The prompt file of the plan's benchmark (its row in benchmarks/RESULTS.md): N distinct prompts
cycled from the sample datasets (chat, code, tool_calls), each one's last user turn suffixed
` (request i)` so the load drops none as a duplicate. Then time the plan on it:

    .venv/bin/python benchmarks/plan_prompts.py /tmp/p83k.jsonl 83000
    /usr/bin/time .venv/bin/eagle3-data plan --offline --prompts chat=/tmp/p83k.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "include" / "sample_data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("n", type=int, nargs="?", default=83_000)
    args = p.parse_args()
    rows = [
        json.loads(line)
        for name in ("chat", "code", "tool_calls")
        for line in (SAMPLES / f"{name}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    with args.out.open("w") as f:
        for i in range(args.n):
            row = json.loads(json.dumps(rows[i % len(rows)]))
            for message in reversed(row["messages"]):
                if message["role"] == "user" and isinstance(message.get("content"), str):
                    message["content"] += f" (request {i})"
                    break
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
