#!/usr/bin/env bash
# The probe on ONE NVIDIA GPU at Kimi-K2.5's width (benchmarks/gpu_probe.py): prints its figures and
# its seconds per 1,000 trained samples (docs/hidden_states.md, "The drafter's verdict").
#
#   benchmarks/gpu_probe.sh                      # H=7168, 320 rows of ~2,000 tokens, 200 steps
#   benchmarks/gpu_probe.sh --steps 50           # any gpu_probe.py flag passes through
#
# Interpreters: MAIN_PYTHON (torch with CUDA + transformers + safetensors + datasets: the pipeline
# side; default .venv/bin/python) and EAGLE3_SPECULATORS_PYTHON (speculators 0.9.0 with CUDA torch;
# default .venv-speculators/bin/python, `make speculators-venv`).
# Figures go to benchmarks/RESULTS.md by hand, with this command and the GPU name.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=${MAIN_PYTHON:-.venv/bin/python}
export EAGLE3_SPECULATORS_PYTHON=${EAGLE3_SPECULATORS_PYTHON:-.venv-speculators/bin/python}
"$EAGLE3_SPECULATORS_PYTHON" -c "import torch, speculators; assert torch.cuda.is_available(), 'no CUDA in the speculators venv'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
time PYTHONUNBUFFERED=1 timeout 1800 "$MAIN" benchmarks/gpu_probe.py "$@"
