"""The engine fixtures' prestart thread (tests/fixtures/engine.py) creates no logger while pytest
runs tests: pytest iterates `logging`'s logger dict at every test phase, and a logger made on
another thread meanwhile ends the whole session with an INTERNALERROR."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import logging, socket
from eagle3_data.dev.processes import http_ok
from tests.fixtures.engine import before_the_prestart_thread

before_the_prestart_thread()
names = set(logging.root.manager.loggerDict)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
assert not http_ok(f"http://127.0.0.1:{port}/health")  # what the thread does until the server answers
print(sorted(set(logging.root.manager.loggerDict) - names))
"""


def test_the_prestart_threads_health_check_makes_no_logger():
    """In a fresh interpreter (the main tier's process may have imported httpx already): after the
    main thread's `before_the_prestart_thread`, the health check the thread runs adds no logger."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "include"), str(REPO)]))
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
