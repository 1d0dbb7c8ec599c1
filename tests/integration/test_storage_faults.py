"""A writer process killed with SIGKILL mid-stage, then resumed: 0 committed rows lost, 0 duplicated,
at most one part of (paid) work redone. The writer runs in a real subprocess against SeaweedFS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_data.storage import IncompleteStage, StageRef

pytestmark = pytest.mark.slow

N = 60
ROWS_PER_PART = 8
REF = StageRef("date=2026-11-29", "generate_local", "kill_test")

# A generation stage in miniature: skip committed ids, "pay" for each sample (ledger line), write it.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from eagle3_data.storage import ArtifactStore, StageRef, StageWriter, s3_client

    env = os.environ
    client = s3_client(env["T_ENDPOINT"], access_key=env["T_KEY"], secret_key=env["T_SECRET"])
    store = ArtifactStore(client, env["T_BUCKET"])
    ref = StageRef(*json.loads(env["T_REF"]))
    attempt, n = env["T_ATTEMPT"], int(env["T_N"])
    kill_part = int(env.get("T_KILL_BEFORE_PROGRESS_OF_PART", -1))
    kill_rows = int(env.get("T_KILL_AFTER_ROWS", -1))

    real = StageWriter._write_progress
    def maybe_die(self, record):
        if record["part"] == kill_part:
            os.kill(os.getpid(), signal.SIGKILL)  # part uploaded, progress record not yet
        real(self, record)
    StageWriter._write_progress = maybe_die

    ledger = open(env["T_LEDGER"], "a")
    if env.get("T_DISCARD"):  # a replacement on purpose (--fresh): a committed stage is never overwritten
        store.delete(ref)
    with StageWriter(store, ref, "generations", rows_per_part=int(env["T_RPP"]), params={"temperature": 1.0}) as w:
        done = w.committed_sample_ids()
        written = 0
        for i in range(n):
            sid = f"s{i:05d}"
            if sid in done:
                continue
            ledger.write(sid + "\\n"); ledger.flush(); os.fsync(ledger.fileno())
            w.write([{"sample_id": sid, "dataset": ref.dataset, "source": "sglang", "status": "ok",
                      "content": f"attempt-{attempt}", "output_ids": [i, i + 1]}])
            written += 1
            print(f"wrote {written} committed {w.rows_committed}", flush=True)
            if written == kill_rows:
                os.kill(os.getpid(), signal.SIGKILL)
            if env.get("T_SLOW"):
                time.sleep(0.02)
        if env.get("T_KILL_BEFORE_MANIFEST"):
            w.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        w.commit(extra={"counts": {"ok": n}})
    """
)


@pytest.fixture
def run_child(tmp_path, s3_server, s3_bucket):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ledger = tmp_path / "ledger.txt"

    def run(attempt: int, wait: bool = True, **env_extra) -> subprocess.Popen | subprocess.CompletedProcess:
        env = dict(
            os.environ,
            T_ENDPOINT=s3_server.endpoint_url,
            T_KEY=s3_server.access_key,
            T_SECRET=s3_server.secret_key,
            T_BUCKET=s3_bucket,
            T_REF=json.dumps([REF.run_key, REF.stage, REF.dataset]),
            T_ATTEMPT=str(attempt),
            T_N=str(N),
            T_RPP=str(ROWS_PER_PART),
            T_LEDGER=str(ledger),
            **{k: str(v) for k, v in env_extra.items()},
        )
        cmd = [sys.executable, str(script)]
        if not wait:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    run.ledger = ledger
    return run


def assert_exact_and_kept(store, committed_before: set[str], ledger: Path) -> None:
    table = store.read_table(REF, columns=["sample_id", "content"])
    ids = table.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicated rows"
    assert set(ids) == {f"s{i:05d}" for i in range(N)}, "lost rows"
    content = dict(zip(ids, table.column("content").to_pylist()))
    assert committed_before and all(content[s] == "attempt-1" for s in committed_before), "committed rows were redone"
    paid = ledger.read_text().split()
    assert len(paid) - N <= ROWS_PER_PART, f"{len(paid) - N} samples generated twice: more than one part lost"
    store.verify(REF)


def test_sigkill_mid_part_then_resume(store, run_child):
    first = run_child(1, T_KILL_AFTER_ROWS=3 * ROWS_PER_PART + 5)
    assert first.returncode == -signal.SIGKILL
    committed = store.committed_sample_ids(REF)
    assert len(committed) == 3 * ROWS_PER_PART and not store.is_complete(REF)
    second = run_child(2)
    assert second.returncode == 0, second.stderr
    assert_exact_and_kept(store, committed, run_child.ledger)
    assert store.read_manifest(REF)["extra"]["writer"]["resumed_rows"] == 3 * ROWS_PER_PART


def test_kill_between_part_upload_and_progress_record_then_resume(store, run_child):
    first = run_child(1, T_KILL_BEFORE_PROGRESS_OF_PART=2)
    assert first.returncode == -signal.SIGKILL
    assert store.head_object(REF, "part-00002.parquet")  # the orphan is there...
    committed = store.committed_sample_ids(REF)
    assert len(committed) == 2 * ROWS_PER_PART  # ...but not counted
    second = run_child(2)
    assert second.returncode == 0, second.stderr
    assert_exact_and_kept(store, committed, run_child.ledger)
    assert store.read_manifest(REF)["extra"]["writer"]["orphan_parts_removed"] == 1


def test_kill_by_parent_at_random_point_then_resume(store, run_child):
    proc = run_child(1, wait=False, T_SLOW=1)
    for line in proc.stdout:  # kill from outside once some parts are in, mid-part
        if int(line.split()[-1]) >= 2 * ROWS_PER_PART and int(line.split()[1]) % ROWS_PER_PART == 3:
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()
    committed = store.committed_sample_ids(REF)
    second = run_child(2)
    assert second.returncode == 0, second.stderr
    assert_exact_and_kept(store, committed, run_child.ledger)


def test_kill_before_manifest_then_resume_commits_without_rework(store, run_child):
    first = run_child(1, T_KILL_BEFORE_MANIFEST=1)
    assert first.returncode == -signal.SIGKILL and not store.is_complete(REF)
    committed = store.committed_sample_ids(REF)
    assert len(committed) == N
    lines_before = len(run_child.ledger.read_text().split())
    second = run_child(2)
    assert second.returncode == 0, second.stderr
    assert len(run_child.ledger.read_text().split()) == lines_before  # nothing paid twice
    assert_exact_and_kept(store, committed, run_child.ledger)


def test_kill_during_rerun_of_complete_stage_then_resume(store, run_child):
    assert run_child(1).returncode == 0
    old = store.read_manifest(REF)
    refused = run_child(2)  # a committed stage is never overwritten: refused, nothing touched
    assert refused.returncode != 0 and "is committed" in refused.stderr and store.read_manifest(REF) == old
    rerun = run_child(2, T_KILL_AFTER_ROWS=ROWS_PER_PART + 2, T_DISCARD=1)  # a replacement redoes the stage...
    assert rerun.returncode == -signal.SIGKILL
    assert not store.is_complete(REF)  # ...and its first act was to remove the old manifest
    with pytest.raises(IncompleteStage):
        store.read_table(REF)
    committed = store.committed_sample_ids(REF)
    assert len(committed) == ROWS_PER_PART
    assert run_child(3).returncode == 0
    table = store.read_table(REF, columns=["sample_id", "content"])
    ids = table.column("sample_id").to_pylist()
    assert sorted(ids) == [f"s{i:05d}" for i in range(N)] and len(ids) == N
    content = dict(zip(ids, table.column("content").to_pylist()))
    assert {content[s] for s in committed} == {"attempt-2"} and "attempt-1" not in content.values()
    assert store.read_manifest(REF)["manifest_sha256"] != old["manifest_sha256"]
