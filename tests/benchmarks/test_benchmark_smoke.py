"""Every benchmark runs, at its smoke size (benchmarks/run_all.py --smoke runs the same commands):
a benchmark the code has drifted away from fails here, not on the day someone wants its figure.
Each runs as its own `nice -n 19` process with one compute thread (run_all.SMOKE_ENV says why),
in the background from the session's start (conftest.py says why), and must exit 0 and print its
`RATIO <name> ...` line. A missing requirement (the vLLM venv) is a failure, not a skip. Nothing
here is timed: the figures are benchmarks/RESULTS.md's, measured with their commands on a quiet
machine."""

from __future__ import annotations

import pytest
import run_all  # benchmarks/, put on the path by conftest.py


@pytest.mark.timeout(2400 + 120)  # conftest.BOUND_S stops the smoke first; pytest's 600 s would cut the wait short
@pytest.mark.parametrize("name", list(run_all.BENCHMARKS))
def test_benchmark_smoke(name, smoke_outcome):
    cmd, done = smoke_outcome(name)  # FileNotFoundError (a failure) when its requirement is missing
    tail = done.stdout[-4000:]
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{tail}"
    ratios = [line for line in done.stdout.splitlines() if line.startswith(f"RATIO {name} ")]
    assert ratios, f"{' '.join(cmd)} printed no 'RATIO {name} ...' line:\n{tail}"
    print("\n".join(ratios))
