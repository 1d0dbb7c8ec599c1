"""One writer per stage, on the real SeaweedFS: conditional puts, the lease, and Why 1 of issue 13.

The paid endpoint is the dev inference server; its per-sample request counters say who paid.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from eagle3_data.storage import LeaseLost, StageBusy, StageRef
from eagle3_data.storage.lease import LEASE, acquire_lease, refuse_if_busy
from eagle3_data.storage.writer import StageWriter
from tests.generation_calls import MODEL, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, prompts

REF = StageRef(run_key="date=2026-11-29", stage="generate_overflow", dataset="tool_calls")


def _code(exc: ClientError) -> int:
    return exc.response["ResponseMetadata"]["HTTPStatusCode"]


def test_seaweedfs_honours_conditional_puts(s3, s3_bucket):
    """The lease rests on these three answers; if a server version changed them, this fails first."""
    first = s3.put_object(Bucket=s3_bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert _code(exc.value) == 412
    second = s3.put_object(Bucket=s3_bucket, Key="k", Body=b"3", IfMatch=first["ETag"])
    with pytest.raises(ClientError) as exc:  # a stale etag: someone wrote in between
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"4", IfMatch=first["ETag"])
    assert _code(exc.value) == 412
    assert s3.get_object(Bucket=s3_bucket, Key="k")["ETag"] == second["ETag"]

    _race_has_one_winner(s3, s3_bucket, "race", IfNoneMatch="*")
    base = s3.put_object(Bucket=s3_bucket, Key="match", Body=b"base")["ETag"]
    _race_has_one_winner(s3, s3_bucket, "match", IfMatch=base)  # SeaweedFS checks under its object lock


def _race_has_one_winner(s3, bucket: str, key: str, threads: int = 16, **condition) -> None:
    """`threads` conditional PUTs of one key released together: exactly one wins, and its body is
    what the object holds; the others get 409/412."""
    barrier = threading.Barrier(threads)

    def put(i):
        barrier.wait()
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=str(i).encode(), **condition)
            return i
        except ClientError as e:
            assert _code(e) in (409, 412)
            return None

    with ThreadPoolExecutor(threads) as pool:
        winners = [i for i in pool.map(put, range(threads)) if i is not None]
    assert len(winners) == 1
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == str(winners[0]).encode()


def test_second_writer_fails_fast_naming_holder_and_expiry(store):
    held = acquire_lease(store, REF, ttl_s=60, owner="worker-a (task 1)")
    try:
        with pytest.raises(StageBusy, match=r"being written by worker-a \(task 1\).*expires 20\d\d-.*in \d+ s"):
            acquire_lease(store, REF, ttl_s=60, owner="worker-b")
        with pytest.raises(StageBusy):
            with StageWriter(store, REF, "generations"):
                pass
    finally:
        held.release()


def test_early_refusal_reads_the_lease_without_taking_it(store):
    """What `generate` checks before loading its tokenizer: a live holder is refused with the same
    message; a free or released lease passes, and the check writes nothing (the writer takes it)."""
    ref = StageRef(run_key="early", stage="generate_overflow", dataset="chat")
    refuse_if_busy(store, ref)  # no lease object at all
    assert not store.list_objects(store.key(ref, LEASE))
    held = acquire_lease(store, ref, ttl_s=60, owner="worker-a (task 1)", heartbeat=False)
    with pytest.raises(StageBusy, match=r"being written by worker-a \(task 1\).*expires"):
        refuse_if_busy(store, ref)
    held.release()
    refuse_if_busy(store, ref)
    acquire_lease(store, ref, ttl_s=60, owner="worker-b", heartbeat=False).release()
    again = acquire_lease(store, REF, owner="worker-b")  # released: free at once
    assert again.took_over is None
    again.release()


def test_expired_lease_is_taken_over_and_the_old_owner_stops(store):
    old = acquire_lease(store, REF, ttl_s=1, owner="zombie", heartbeat=False)
    time.sleep(2.5)  # past expiry on the server's clock (Last-Modified has 1 s resolution)
    new = acquire_lease(store, REF, ttl_s=60, owner="retry")
    assert new.took_over["owner"] == "zombie"
    with pytest.raises(LeaseLost, match="taken over"):
        old.renew()
    with pytest.raises(LeaseLost):
        old.check()
    new.release()


ROUNDS = 32  # before the fix, 4 of 30 rounds had two winners: 32 clean rounds make a pass by luck < 1 %


def test_racing_takeovers_of_an_expired_lease_have_one_winner(store):
    """8 threads of one process race to take over a lease, ROUNDS times: exactly one wins each round,
    and the lease object is the winner's. Odd rounds: a holder on another host whose lease expired
    (ttl 0); even rounds: a holder on this host whose process is gone. The same-process case is the
    one that failed: a thread read the winner's fresh record before the winner had registered its
    token as live, judged that same-pid holder dead, and took the lease over too."""
    import json
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    n = 8
    for r in range(ROUNDS):
        ref = StageRef(run_key=f"race-{r}", stage="generate_overflow", dataset="d")
        dead = (
            {"host": "elsewhere", "pid": 1, "ttl_s": 0}
            if r % 2
            else {"host": socket.gethostname(), "pid": gone.pid, "ttl_s": 600}
        )
        store.client.put_object(
            Bucket=store.bucket,
            Key=store.key(ref, LEASE),
            Body=json.dumps({"owner": "dead", "token": "0" * 32, "state": "held", **dead}).encode(),
        )
        barrier = threading.Barrier(n)

        def take(i, barrier=barrier, ref=ref):  # this round's, bound while the loop runs
            barrier.wait()
            try:
                return acquire_lease(store, ref, ttl_s=60, owner=f"w{i}", heartbeat=False)
            except StageBusy as exc:
                assert "being written by w" in str(exc)  # refused by the winner, not by the dead holder
                return None

        with ThreadPoolExecutor(n) as pool:
            leases = [x for x in pool.map(take, range(n)) if x is not None]
        assert len(leases) == 1, f"round {r}: {len(leases)} winners {[x.owner for x in leases]}"
        record = json.loads(store.client.get_object(Bucket=store.bucket, Key=store.key(ref, LEASE))["Body"].read())
        assert record["token"] == leases[0].token and leases[0].took_over["owner"] == "dead"
        leases[0].release()


def test_a_holder_left_a_zombie_is_taken_over_at_once(store):
    """A SIGKILLed worker's task process stays a zombie where PID 1 does not reap orphans (this
    sandbox's does not): kill(pid, 0) still finds it. Its lease is dead all the same, so the retry
    takes it over at once instead of being refused until the ttl runs out (up to 120 s of
    StageBusy retries, the cluster test's killed run). Here the zombie is this process's own
    unreaped child."""
    import json
    import os
    import socket
    import subprocess

    from eagle3_data.storage.lease import is_zombie

    zombie = subprocess.Popen(["true"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, and left unreaped: a zombie
    assert is_zombie(zombie.pid)
    try:
        ref = StageRef(run_key="zombie", stage="generate_overflow", dataset="d")
        store.client.put_object(
            Bucket=store.bucket,
            Key=store.key(ref, LEASE),
            Body=json.dumps(
                {"owner": "killed", "token": "0" * 32, "state": "held", "host": socket.gethostname(), "pid": zombie.pid}
            ).encode(),
        )
        lease = acquire_lease(store, ref, ttl_s=600, owner="retry", heartbeat=False)
        assert lease.took_over["owner"] == "killed"
        lease.release()
    finally:
        zombie.wait()


# -- Why 1 of issue 13, with the dev server as the paid endpoint ------------------------------------------
def _overflow(store, server, todo, tmp_path, **kw):
    return generate_overflow(
        store,
        REF,
        todo,
        server.tokenizer,
        server.url + "/v1",
        SECRET,
        MODEL,
        {},
        None,
        sampling=SAMPLING,
        concurrency=4,
        rows_per_part=8,
        journal_dir=tmp_path,
        **kw,
    )


@pytest.fixture
def slow_server(start_dev_server, kimi_tokenizer):
    server = start_dev_server({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.05}}}})
    server.tokenizer = kimi_tokenizer
    return server


def _requests(server) -> dict[str, int]:
    return server.stats()["requests"].get("chat", {})


def _wait_for_requests(server, n: int) -> None:
    while sum(_requests(server).values()) < n:
        time.sleep(0.02)


def test_two_simultaneous_writers_one_pays(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Why 1a: two `generate overflow` on one run key and dataset: one runs, the other is refused.
    The second starts once the first has sent a request (so the two overlap on a loaded machine
    too: 40 answers at 0.3 s over 4 slots keep the first busy for ~3 s)."""
    slow_server = start_dev_server({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.3}}}})
    slow_server.tokenizer = kimi_tokenizer
    todo = prompts(40)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_overflow, store, slow_server, todo, tmp_path / "j0")]
        _wait_for_requests(slow_server, 1)
        futures.append(pool.submit(_overflow, store, slow_server, todo, tmp_path / "j1"))
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result())
            except StageBusy as exc:
                outcomes.append(exc)
    busy = [o for o in outcomes if isinstance(o, StageBusy)]
    done = [o for o in outcomes if isinstance(o, dict)]
    assert len(busy) == 1 and len(done) == 1 and done[0]["complete"], outcomes
    counts = _requests(slow_server)
    assert sorted(counts) == sorted(p["sample_id"] for p in todo) and set(counts.values()) == {1}  # each paid once
    store.verify(REF)
    assert store.read_manifest(REF)["rows"] == 40


def test_second_writer_started_later_pays_nothing(store, slow_server, tmp_path):
    """Why 1b: a writer started while the first is mid-stage (its journal live) is refused before any request."""
    todo = prompts(40)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_overflow, store, slow_server, todo, tmp_path)
        _wait_for_requests(slow_server, 10)
        with pytest.raises(StageBusy, match="refusing a second writer"):
            _overflow(store, slow_server, todo, tmp_path)  # same journal dir, as on one machine
        summary = first.result()
    assert summary["complete"]
    assert set(_requests(slow_server).values()) == {1} and len(_requests(slow_server)) == 40
    store.verify(REF)


def test_zombie_writer_cannot_corrupt_the_stage(store, tmp_path):
    """Why 1c: a writer whose lease expired (a zombie) is taken over; when it wakes it writes nothing,
    so the complete stage's parts match its manifest."""
    rows = [{"sample_id": f"s{i:03d}", "dataset": "d", "status": "ok"} for i in range(12)]
    zombie = StageWriter(store, REF, "generations", rows_per_part=4, lease_ttl_s=1)
    zombie.__enter__()
    zombie.lease._stop.set()  # the zombie stops heartbeating (a hung process)
    zombie.write(rows[:4])  # one part committed while the lease was valid
    time.sleep(2.5)
    with StageWriter(store, REF, "generations", rows_per_part=4) as retry:
        assert retry.committed_sample_ids() == {r["sample_id"] for r in rows[:4]}  # verified, resumed
        retry.write(rows[4:])
        retry.commit()
    with pytest.raises(LeaseLost):
        zombie.write([{**r, "error": "zombie"} for r in rows[4:8]])  # would overwrite part-00001
    zombie.__exit__(LeaseLost, None, None)
    store.verify(REF)
    table = store.read_table(REF).to_pylist()
    assert sorted(r["sample_id"] for r in table) == [r["sample_id"] for r in rows]
    assert not any(r["error"] for r in table)
    assert store.client.get_object(Bucket=store.bucket, Key=store.key(REF, LEASE))  # lease object remains


def test_owner_names_the_airflow_task_try(store, monkeypatch):
    for k, v in {
        "AIRFLOW_CTX_DAG_ID": "eagle3_datagen",
        "AIRFLOW_CTX_TASK_ID": "generate_overflow",
        "AIRFLOW_CTX_DAG_RUN_ID": "scheduled__2026-11-29",
        "AIRFLOW_CTX_TRY_NUMBER": "1",
    }.items():
        monkeypatch.setenv(k, v)
    held = acquire_lease(store, REF, heartbeat=False)
    try:
        with pytest.raises(
            StageBusy, match=r"Airflow eagle3_datagen.generate_overflow run scheduled__2026-11-29 try 1"
        ):
            acquire_lease(store, REF, heartbeat=False)
    finally:
        held.release()


@pytest.mark.slow
def test_two_cli_processes_on_one_stage_one_pays_the_other_exits_2(
    store, s3_server, start_dev_server, kimi_tokenizer_dir, tmp_path
):
    """Why 1 as a user meets it: two `eagle3-data generate overflow` processes, same run key and
    dataset. The second one starts while the first is paying; it exits 2 naming the holder."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    server = start_dev_server({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.05}}}})
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"n {i}"}]}) + "\n" for i in range(40)))
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        OPENROUTER_API_KEY=SECRET,
        EAGLE3_JOURNAL_DIR=str(tmp_path / "journal"),
    )
    cmd = [
        str(Path(sys.executable).parent / "eagle3-data"),
        "generate",
        "overflow",
        "--dataset",
        "chat",
        "--prompts",
        str(src),
        "--run-key",
        "two",
        "--bucket",
        store.bucket,
        "--prefix",
        store.prefix,
        "--endpoint-url",
        s3_server.endpoint_url,
        "--overflow-fraction",
        "1",
        "--tokenizer",
        str(kimi_tokenizer_dir),
        "--base-url",
        server.url + "/v1",
        "--concurrency",
        "1",
        "--rows-per-part",
        "10",
    ]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_requests(server, 3)  # the first one holds the lease and pays
    os.kill(first.pid, signal.SIGSTOP)  # frozen mid-stage (alive, lease unexpired): the second must not wait on timing
    try:
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 2, second.stderr[-2000:]
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("eagle3-data: error: ") and "is being written by" in last and "expires" in last
    assert "Traceback" not in second.stderr
    counts = _requests(server)
    assert len(counts) == 40 and set(counts.values()) == {1}  # exactly one writer paid
    store.verify(StageRef("two", "generate_overflow", "chat"))
