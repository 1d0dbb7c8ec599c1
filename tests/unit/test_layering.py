"""Airflow at the edges: nothing under include/eagle3_data/ imports Airflow.

The library runs in workers, in the CLI and in a wheel installed without Airflow; only dags/,
plugins/ and the checkout's launchers (include/eagle3_devtools/) may import it. An AST scan sees
every import, including lazy ones inside functions that importing the module would never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import eagle3_data

LIBRARY = Path(eagle3_data.__file__).resolve().parent
FORBIDDEN = "airflow"


def _forbidden(name: str | None, forbidden: tuple[str, ...]) -> bool:
    return name is not None and any(name == f or name.startswith(f + ".") for f in forbidden)


def airflow_imports(source: str, filename: str = "<string>", forbidden: tuple[str, ...] = (FORBIDDEN,)) -> list[str]:
    """`file:line module` for each import of Airflow (or of the `forbidden` top-level modules) in
    `source`: import statements, and importlib.import_module / __import__ calls with a literal
    module name."""
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
        found += [f"{filename}:{node.lineno} {n}" for n in names if _forbidden(n, forbidden)]
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


@pytest.mark.parametrize(
    "source", ["import airflowish", "from .airflow import x", "x = 'airflow'", "from eagle3_data import airflow_free"]
)
def test_scanner_ignores_lookalikes(source):
    assert airflow_imports(source) == []


def test_library_never_imports_airflow():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 20, f"expected the whole package under {LIBRARY}"
    hits = [hit for f in files for hit in airflow_imports(f.read_text(), str(f.relative_to(LIBRARY.parent)))]
    assert hits == [], (
        "the library imports Airflow (move it to dags/, plugins/ or include/eagle3_devtools/):\n" + "\n".join(hits)
    )


def test_library_never_imports_the_airflow_side():
    """The DAG's Airflow names (id, queue, pool, connection ids) and its trigger form live in
    plugins/eagle3_airflow.py beside the hooks: on Airflow's sys.path, not in the wheel. A library
    function that needs a connection takes what it reads (a client, endpoints) from its caller."""
    plugins = LIBRARY.parents[1] / "plugins"
    modules = tuple(sorted(p.stem for p in plugins.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()))
    assert {"eagle3_airflow", "hooks"} <= set(modules), modules
    files = sorted(LIBRARY.rglob("*.py"))
    hits = [h for f in files for h in airflow_imports(f.read_text(), str(f.relative_to(LIBRARY.parent)), modules)]
    assert hits == [], "the library imports plugins/ (pass the value in instead):\n" + "\n".join(hits)


def test_devtools_are_outside_the_library():
    """The launchers that do import Airflow live beside the package, not in it."""
    import eagle3_devtools

    devtools = Path(eagle3_devtools.__file__).resolve().parent
    assert devtools.parent == LIBRARY.parent and not devtools.is_relative_to(LIBRARY)
    assert any(airflow_imports((devtools / f).read_text()) for f in ("demo.py", "local_airflow.py"))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the library modules it imports at run time (top level and inside functions;
    `if TYPE_CHECKING:` blocks are annotations, not imports)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body
            for n in ast.walk(child)
        }
        targets = []
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets += [base] + [f"{base}.{a.name}" for a in node.names]
        graph[name] = {r for t in targets if t.startswith(LIBRARY.name) and (r := resolve(t)) and r != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_lazy_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_library():
    """Each module sits above what it imports: no module reaches itself through its imports, lazy
    ones included (a lazy import that closes a circle only hides it until the call)."""
    assert cycles(import_graph(LIBRARY)) == []


def test_the_library_below_the_cli_never_imports_the_dev_stand_ins():
    """The dev server, fake S3 and fault models are reached only from the CLI's `dev` commands and
    the checkout's launchers: a production run cannot start one by accident."""
    graph = import_graph(LIBRARY)
    hits = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if t.startswith(f"{LIBRARY.name}.dev") and not m.startswith((f"{LIBRARY.name}.dev", f"{LIBRARY.name}.cli"))
    )
    assert hits == []


def test_no_private_store_calls_outside_the_store():
    """The writer, leases, checkpoints and the CLI use the store's public object layer."""
    pattern = re.compile(r"\bstore\._[a-z]\w*\(")
    hits = []
    for path in sorted(
        [
            *LIBRARY.rglob("*.py"),
            *(LIBRARY.parents[1] / "plugins").rglob("*.py"),
            *(LIBRARY.parents[1] / "dags").rglob("*.py"),
        ]
    ):
        if path.name == "store.py" and path.parent.name == "storage":
            continue
        hits += [
            f"{path}:{n} {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)
        ]
    assert hits == [], "\n".join(hits)


STAGES = f"{LIBRARY.name}.stages"
ABOVE_THE_STAGES = tuple(f"{LIBRARY.name}.{m}" for m in ("stages", "pipeline", "cli", "report", "dev"))


def _stage_of(module: str) -> str | None:
    """`eagle3_data.stages.merge.stage` -> `merge`; None outside a stage package."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "stages" else None


def stage_crossings(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import of one stage's package by another stage's, and for each import of
    a stage by a module below the stages (what several stages share lives below them)."""
    hits = []
    for module, targets in graph.items():
        for target in targets:
            into = _stage_of(target)
            if into is None:
                continue
            own = _stage_of(module)
            if (own is not None and own != into) or (own is None and not module.startswith(ABOVE_THE_STAGES)):
                hits.append(f"{module} -> {target}")
    return sorted(hits)


def test_crossing_finder_sees_a_stage_reaching_into_another():
    graph = {
        f"{STAGES}.merge.stage": {f"{STAGES}.validate.stage", f"{STAGES}.merge.datasets", f"{LIBRARY.name}.nucleus"},
        f"{LIBRARY.name}.nucleus": {f"{STAGES}.policy.select"},
        f"{LIBRARY.name}.pipeline": {f"{STAGES}.merge.stage"},
    }
    assert stage_crossings(graph) == [
        f"{LIBRARY.name}.nucleus -> {STAGES}.policy.select",
        f"{STAGES}.merge.stage -> {STAGES}.validate.stage",
    ]


def test_one_stage_one_package():
    """Each stage is one package under stages/ (its logic, `stage.py`, `cli.py`); no stage imports
    another, and nothing below the stages imports one, lazy imports included."""
    graph = import_graph(LIBRARY)
    packages = sorted({s for m in graph if (s := _stage_of(m))})
    flow = ["audit", "prompts", "generate", "reconstruct", "policy", "validate", "merge", "hidden_states", "probe"]
    assert packages == sorted([*flow, "publish"])
    for stage in packages:
        assert f"{STAGES}.{stage}.stage" in graph and f"{STAGES}.{stage}.cli" in graph, stage
    assert stage_crossings(graph) == []


def _imported_top_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_a_module_run_as_a_script_is_not_shadowed_by_its_siblings():
    """A file run by path (`python .../trainer_reader.py` in the speculators venv) has its own
    folder first on sys.path, so a sibling module named like a package it imports (an
    `exports/speculators.py` beside the reader) replaces that package in the child."""
    scripts = [p for p in LIBRARY.rglob("*.py") if '__name__ == "__main__"' in p.read_text()]
    assert any(p.name == "trainer_reader.py" for p in scripts)
    hits = []
    for script in scripts:
        siblings = {p.stem for p in script.parent.glob("*.py")} - {script.stem, "__init__"}
        hits += [f"{script.relative_to(LIBRARY)} imports {n}" for n in sorted(_imported_top_names(script) & siblings)]
    assert hits == []
