#!/usr/bin/env bash
# Both hidden-state backends on ONE NVIDIA H200 (or any CUDA GPU), bf16, a mid-size random
# DeepSeek-V3 built locally (no hub); prints tokens/s of each and the max relative error between
# them. Target: under 8 minutes on one H200 (model build ~1 min, transformers pass, vLLM start
# with torch.compile ~1-2 min, vLLM pass).
#
#   benchmarks/gpu_extract.sh                    # defaults: L=16, H=2048, 16 experts, 192 samples
#   benchmarks/gpu_extract.sh --samples 96       # any gpu_extract.py flag passes through
#
# Interpreters (nothing is installed into the system python):
#   MAIN_PYTHON  torch (CUDA) + transformers>=5.17 + safetensors: the pipeline side, transformers
#                backend. Default: the first of .venv/bin/python, the vLLM python, python3 that sees a GPU.
#   EAGLE3_VLLM_PYTHON  a python with CUDA vLLM 0.32 (`pip install vllm==0.32.0` in its own venv;
#                NOT requirements-vllm.txt, which is the CPU build). Default: .venv-vllm-cuda/bin/python,
#                created here with pip when missing (needs network).
# Figures go to benchmarks/RESULTS.md by hand, with this command and the GPU name.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PY=${EAGLE3_VLLM_PYTHON:-.venv-vllm-cuda/bin/python}
if ! "$VLLM_PY" -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "creating .venv-vllm-cuda (CUDA vLLM 0.32.0; a few minutes, needs network)" >&2
  python3 -m venv .venv-vllm-cuda
  .venv-vllm-cuda/bin/python -m pip install --quiet vllm==0.32.0
  VLLM_PY=.venv-vllm-cuda/bin/python
fi
export EAGLE3_VLLM_PYTHON=$VLLM_PY

# The pipeline side needs only torch, transformers>=5.17 and safetensors (hidden_states/ imports
# nothing else), so CUDA vLLM's own venv (transformers 5.19) serves when no other python sees the GPU.
pick_main() {
  for py in "${MAIN_PYTHON:-}" .venv/bin/python "$VLLM_PY" python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c "import torch, transformers, safetensors; assert torch.cuda.is_available()" 2>/dev/null; then
      echo "$py"; return
    fi
  done
  echo "no python with CUDA torch + transformers found (set MAIN_PYTHON)" >&2; exit 2
}
MAIN=$(pick_main)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "main: $MAIN ($("$MAIN" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'))"
echo "vllm: $VLLM_PY ($("$VLLM_PY" -c 'import vllm; print(vllm.__version__)'))"
time PYTHONUNBUFFERED=1 timeout 900 "$MAIN" benchmarks/gpu_extract.py "$@"
