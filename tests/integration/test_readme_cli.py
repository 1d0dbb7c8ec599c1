"""The README's "CLI in five minutes" block runs as pasted: extracted from README.md, run as one
`bash -e` script in a clean environment (no AWS_* variables, no PATH to the venv), from a folder
that holds the checkout's `.venv` and `include/` as a fresh clone does, so its output lands
there and not in the checkout. Every command must succeed and leave what the block promises.
A README edit that breaks the block fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SECTION = "## The CLI in five minutes"


def readme_block() -> str:
    """The first ```bash block after the section heading."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    found = re.search(r"```bash\n(.*?)```", text.split(SECTION, 1)[1], re.S)
    assert found, f"no bash block under {SECTION!r}"
    return found.group(1)


def test_the_readme_cli_block_runs_as_pasted(tmp_path):
    for name in (".venv", "include"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "home").mkdir()
    script = tmp_path / "five-minutes.sh"
    script.write_text(readme_block())
    # a clean shell: what a new terminal has; the suite's cache (dev: builds) and, where the
    # package is not installed from this checkout, the checkout's include/ on the path
    env = {
        "HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        **{
            k: os.environ[k]
            for k in ("EAGLE3_DATA_CACHE", "PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
            if k in os.environ
        },
    }
    work = tmp_path / "demo-output" / "cli"
    try:
        done = subprocess.run(
            ["bash", "-e", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
    finally:  # the block's last line stops S3; a failure before it must not leave SeaweedFS running
        if (work / "s3" / "weed.pid").exists():
            subprocess.run(
                [str(REPO / ".venv" / "bin" / "eagle3-data"), "dev", "s3", "stop", "--dir", str(work / "s3")],
                env=env,
                capture_output=True,
                timeout=60,
            )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "Traceback" not in done.stderr and "eagle3-data: error" not in done.stderr
    assert done.stdout.rstrip().endswith("stopped")  # the last line: S3 stopped
    # each stage printed its result; publish's (the run summary) is the last JSON object before the report
    summary = json.loads(done.stdout[done.stdout.rindex('\n{\n "run_key"') + 1 : done.stdout.rindex("\n}\n") + 2])
    assert summary["run_key"] == "cli1" and summary["datasets"] == ["chat"] and summary["changed"] is True
    assert summary["merged_uri"] and summary["hidden_states_uri"] and "tokenizer" in summary["stand_ins"]
    html = (work / "report.html").read_text(encoding="utf-8")
    assert "EAGLE-3 validation report: cli1" in html and "chat" in html and "passed" in html
    assert list((work / "specforge").rglob("*.ckpt")), "export-specforge wrote no .ckpt"
    assert list((work / "speculators").glob("data-*.arrow")) and list((work / "speculators").glob("d2t-*.npy"))
