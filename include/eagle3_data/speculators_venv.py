"""Where the side venvs' interpreters are: the probe and the export check run the trainers' own
code in the speculators venv, the vLLM backend its engine in the vLLM venv (their pins differ from
ours: requirements-speculators.txt, requirements-vllm.txt). Below all of them, so none imports
another for it."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_data.errors import UserError

PYTHON_ENV = "EAGLE3_SPECULATORS_PYTHON"
REPO = Path(__file__).resolve().parents[2]


def venv_python(env: str, venv: str, requirements: str, what: str) -> str:
    """A side venv's interpreter (its pins differ from ours): $`env`, else the checkout's `venv`; a
    UserError saying how to build it (`make {venv without its dot}`) when there is none."""
    path = os.environ.get(env) or str(REPO / venv / "bin" / "python")
    if not Path(path).exists():
        raise UserError(
            f"{what} at {path} (run `make {venv.lstrip('.').removeprefix('venv-')}-venv`, or set {env} to the "
            f"python of a venv with {requirements})"
        )
    return path


def speculators_python() -> str:
    """The speculators venv's interpreter: $EAGLE3_SPECULATORS_PYTHON, else the checkout's .venv-speculators."""
    return venv_python(PYTHON_ENV, ".venv-speculators", "requirements-speculators.txt", "no speculators interpreter")
