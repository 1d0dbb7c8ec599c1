"""Run in .venv-speculators: speculators' own ArrowDataset (the trainer's reader) over an export;
every sample it serves is written back as safetensors for the test to compare bit for bit.
argv: export dir, bf16|fp8, out dir."""

import sys
from pathlib import Path

import torch
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import save_file
from speculators.train.data import ArrowDataset
from speculators.train.recovery import SampleUnavailable

export, kind, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
transfer = FP8Transfer(export / "hidden_states") if kind == "fp8" else None
dataset = ArrowDataset(max_len=4096, datapath=str(export), transfer=transfer, on_missing="raise")
out.mkdir(parents=True, exist_ok=True)
for i in range(len(dataset)):
    sample = dataset[i]
    if isinstance(sample, SampleUnavailable):
        sys.exit(f"sample {i} unavailable: {sample}")
    save_file(
        {k: v.contiguous() for k, v in sample.items() if isinstance(v, torch.Tensor)}, str(out / f"{i}.safetensors")
    )
print(len(dataset))
