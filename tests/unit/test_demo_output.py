"""The demo's output shaping (eagle3_devtools.demo_output), without running the demo (minutes):
its meant gate failure said in one paragraph (an unexpected one falls back to Airflow's log,
tracebacks included), everything a run writes to fds 1 and 2 kept in a file, and a heartbeat
naming the phase when stdout is piped."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from eagle3_devtools.demo_output import HEARTBEAT_S, Heartbeat, captured_output, expected_failure

# The task states of the demo's gate run as it ended (measured on a demo run).
GATE_RUN = [
    ("audit_tokenizer", "", "success", 1.2),
    ("commit_hidden_states", "", "upstream_failed", 0.0),
    ("dataset.generate_local", "broken", "success", 4.3),
    ("dataset.generate_overflow", "broken", "success", 9.0),
    ("dataset.load_route", "broken", "success", 7.5),
    ("dataset.reconstruct", "broken", "success", 1.7),
    ("dataset.score_policy", "broken", "success", 1.4),
    ("dataset.validate", "broken", "failed", 2.2),
    ("extract_hidden_states", "", "upstream_failed", 0.0),
    ("merge", "", "failed", 3.8),
    ("plan_hidden_states", "", "upstream_failed", 0.0),
    ("publish", "", "failed", 1.1),
]
REASONS = [
    "local round trip: bpe_only rate 1.0000 exceeds 0.1",
    "overflow billing: aggregate deviation -42.5651% exceeds ±1.00%",
]
GATES = {
    "broken": {
        "passed": False,
        "reasons": REASONS,
        "report_uri": "s3://b/runs/demo-dev-gate/validate/broken/report.json",
    }
}
LOG = "Traceback (most recent call last):\n  ...\n" * 3 + "[warning] No tasks to run. unrunnable tasks: {...}\n" * 3


def test_the_meant_gate_failure_is_one_paragraph_with_its_reasons(tmp_path):
    """Instead of three tracebacks and three 'No tasks to run' warnings: what failed, why, and
    where Airflow's log of it is."""
    text = expected_failure("broken", GATE_RUN, GATES, tmp_path / "demo-dev-gate.log", LOG)
    assert text is not None and "\n" not in text, text
    assert text.startswith("demo: dataset 'broken' failed its gate as meant: " + "; ".join(REASONS)), text
    assert GATES["broken"]["report_uri"] in text and "nothing was published" in text
    assert (
        "then merge and publish refused" in text
        and "commit_hidden_states, extract_hidden_states, plan_hidden_states did not run" in text
    )
    assert "(3 traceback(s), all from this failure)" in text and "demo-dev-gate.log" in text


def test_any_other_failure_is_left_to_airflows_log(tmp_path):
    """A failure the demo did not mean is not summarised away: None, and the caller prints the log."""
    log = tmp_path / "x.log"
    other_task = [(t, m, "failed" if t == "dataset.generate_local" else s, d) for t, m, s, d in GATE_RUN]
    assert expected_failure("broken", other_task, GATES, log, LOG) is None
    passed = {"broken": {**GATES["broken"], "passed": True, "reasons": []}}
    assert expected_failure("broken", GATE_RUN, passed, log, LOG) is None
    two = {**GATES, "chat": {"passed": False, "reasons": ["x"], "report_uri": "s3://c"}}
    assert expected_failure("broken", GATE_RUN, two, log, LOG) is None
    no_validate = [(t, m, "success" if t == "dataset.validate" else s, d) for t, m, s, d in GATE_RUN]
    assert expected_failure("broken", no_validate, GATES, log, LOG) is None


def test_captured_output_takes_fds_1_and_2_and_gives_them_back(tmp_path, capfd):
    """Airflow's structlog lines, warnings and child processes write to the fds, not to sys.stdout
    alone: all of it lands in the file, and the terminal gets its fds back after."""
    with captured_output(tmp_path / "run.log") as log:
        os.write(1, b"from fd 1\n")
        os.write(2, b"from fd 2\n")
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    os.write(1, b"after\n")
    assert log.read_text().split("\n")[:3] == ["from fd 1", "from fd 2", "from a child"]
    out, err = capfd.readouterr()
    assert out == "after\n" and err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_heartbeat_names_the_phase_when_piped():
    """Piped, the demo once printed nothing for over a minute: a line names the phase under way
    and its age, often enough that no gap reaches 10 s; a terminal gets none."""
    assert HEARTBEAT_S < 10
    beat = Heartbeat(io.StringIO())
    assert beat.beats and not Heartbeat(_Terminal()).beats
    assert beat.line(0.0) is None  # between phases: nothing to say
    beat.enter("running eagle3_datagen, run key demo-dev")
    assert beat.line(beat.since + 42.4) == "demo: still running eagle3_datagen, run key demo-dev (42 s)"


def test_the_probe_is_said_when_it_ran_and_why_not_when_it_skipped():
    """The demo's machine has no GPU: under the default probe.when auto the probe skips, and the
    demo prints why and how to run it as publish wrote it in the run's summary; a run with the probe
    on shows its verdict; a run that never reached it says nothing of it."""
    from eagle3_data.stages.publish.stage import _probe_not_run
    from eagle3_devtools.demo import probe_lines

    (skipped,) = probe_lines({"training": {"probe_not_run": _probe_not_run("auto")}})
    assert skipped.startswith("Probe: Not run") and "probe.when auto" in skipped and "probe=always" in skipped
    ran = {"simulated_acceptance": 1.234, "acc": [0.61, 0.52], "steps": 4, "uri": "s3://b/runs/k/probe/all/probe.json"}
    (line,) = probe_lines({"training": {"probe": ran}})
    assert "1.23 tokens per step" in line and "acc 0.61, 0.52" in line and ran["uri"] in line
    assert probe_lines({}) == []  # the gate run stops before the probe (no summary either)
