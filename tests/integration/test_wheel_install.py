"""The wheel works on its own: built from the sources, installed non-editable into a fresh venv,
run from a directory outside the checkout, so nothing can resolve through the repo.

The temp venv sees the dependencies of .venv through a path entry (no download of torch), but
not .venv's editable install of this project: a `.pth` that names a directory adds it to
sys.path without running the `.pth` files inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE_IDS = [9413, 1019, 2704, 13, 163607, 1008, 7574, 387, 220, 5512, 13, 163586]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(venv, wheel, env): the project's wheel installed into a new venv without pip."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy: building in the shared checkout would leave build/ and egg-info there
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "include", src / "include", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EAGLE3_CONFIG", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", EAGLE3_DATA_CACHE=str(root / "cache"), PIP_NO_INPUT="1")
    dist = root / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            str(src),
        ],
        root,
        env,
    )
    (wheel,) = dist.glob("eagle3_data-*.whl")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    site = Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env
        ).stdout.strip()
    )
    (site / "zz_dev_deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )  # .venv's deps, appended after the venv's own site
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        root,
        env,
    )
    return venv, wheel, env


def test_wheel_holds_the_library_only(wheel_venv):
    _, wheel, _ = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("eagle3_data/cli/") for n in names)
    assert not [n for n in names if n.startswith(("eagle3_devtools/", "tests/", "dags/", "plugins/"))]


def test_installed_wheel_runs_from_outside_the_repo(wheel_venv, tmp_path):
    venv, _, env = wheel_venv
    where = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import eagle3_data, importlib.util; print(eagle3_data.__file__); "
            "print(importlib.util.find_spec('eagle3_devtools'))",
        ],
        tmp_path,
        env,
    ).stdout.split()
    assert Path(where[0]).resolve().is_relative_to(venv.resolve()), (
        f"eagle3_data imported from {where[0]}, not the wheel"
    )
    assert where[1] == "None", "the checkout's launchers must not ship in (or be reachable from) the wheel"

    cli = str(venv / "bin" / "eagle3-data")
    tok = tmp_path / "tok"
    assert _run([cli, "dev", "build-tokenizer", "--out", str(tok)], tmp_path, env).stdout.strip() == str(tok)
    assert (tok / "tokenizer_config.json").exists()

    rows = tmp_path / "gen.jsonl"
    rows.write_text("".join(json.dumps({"sample_id": f"s{i}", "output_ids": REFERENCE_IDS}) + "\n" for i in range(3)))
    report = tmp_path / "report.json"
    out = _run(
        [
            cli,
            "validate",
            "--tokenizer",
            str(tok),
            "--input",
            str(rows),
            "--report",
            str(report),
            "--workers",
            "1",
            "--thinking",
        ],
        tmp_path,
        env,
    )
    assert "gate passed" in out.stdout
    data = json.loads(report.read_text())
    assert data["counts"]["exact"] == 3 and data["gate"]["passed"]
