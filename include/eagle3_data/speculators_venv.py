"""Where the speculators venv's interpreter is: the probe and the export check run the trainers'
own code there (its pins differ from ours: requirements-speculators.txt). Below both, so neither
imports the other for it."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_data.errors import UserError

PYTHON_ENV = "EAGLE3_SPECULATORS_PYTHON"
REPO = Path(__file__).resolve().parents[2]


def speculators_python() -> str:
    """The speculators venv's interpreter: $EAGLE3_SPECULATORS_PYTHON, else the checkout's .venv-speculators."""
    path = os.environ.get(PYTHON_ENV) or str(REPO / ".venv-speculators" / "bin" / "python")
    if not Path(path).exists():
        raise UserError(
            f"no speculators interpreter at {path} (run `make speculators-venv`, or set "
            f"{PYTHON_ENV} to the python of a venv with requirements-speculators.txt)"
        )
    return path
