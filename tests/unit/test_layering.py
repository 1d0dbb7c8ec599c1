"""Airflow at the edges: nothing under include/eagle3_data/ imports Airflow.

The library runs in workers, in the CLI and in a wheel installed without Airflow; only dags/,
plugins/ and the checkout's launchers (include/eagle3_devtools/) may import it. An AST scan sees
every import, including lazy ones inside functions that importing the module would never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eagle3_data

LIBRARY = Path(eagle3_data.__file__).resolve().parent
FORBIDDEN = "airflow"


def _forbidden(name: str | None) -> bool:
    return bool(name) and (name == FORBIDDEN or name.startswith(FORBIDDEN + "."))


def airflow_imports(source: str, filename: str = "<string>") -> list[str]:
    """`file:line module` for each import of Airflow in `source`: import statements, and
    importlib.import_module / __import__ calls with a literal module name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{filename}:{node.lineno} {n}" for n in names if _forbidden(n)]
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import airflow",
        "import os, airflow.sdk as sdk",
        "from airflow.sdk import dag",
        "def f():\n    from airflow.models import Connection\n",
        "import importlib\nimportlib.import_module('airflow.providers.amazon')",
        "__import__('airflow')",
    ],
)
def test_scanner_sees_every_kind_of_import(source):
    assert airflow_imports(source)


@pytest.mark.parametrize("source", ["import airflowish", "from .airflow import x", "x = 'airflow'", "from eagle3_data import airflow_free"])
def test_scanner_ignores_lookalikes(source):
    assert airflow_imports(source) == []


def test_library_never_imports_airflow():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 20, f"expected the whole package under {LIBRARY}"
    hits = [hit for f in files for hit in airflow_imports(f.read_text(), str(f.relative_to(LIBRARY.parent)))]
    assert hits == [], "the library imports Airflow (move it to dags/, plugins/ or include/eagle3_devtools/):\n" + "\n".join(hits)


def test_devtools_are_outside_the_library():
    """The launchers that do import Airflow live beside the package, not in it."""
    import eagle3_devtools

    devtools = Path(eagle3_devtools.__file__).resolve().parent
    assert devtools.parent == LIBRARY.parent and not devtools.is_relative_to(LIBRARY)
    assert any(airflow_imports((devtools / f).read_text()) for f in ("demo.py", "local_airflow.py"))
