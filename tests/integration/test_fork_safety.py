"""Every library object that owns threads, pools, sockets or files works in a process forked
after the parent used it: Airflow forks each task from a warm parent (a Celery worker whose
warm-up verified the codec), and validate forks its workers.

Each test uses the object in this process, forks, uses it again in the child under a deadline,
and (where the parent goes on) uses it once more here. Before the fix each child hung (a pool
or writer thread missing in the child), crossed answers with the parent on a shared socket, or
broke the parent's lease.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback

import pyarrow as pa
import pytest

from eagle3_data.storage import LeaseLost, StageRef
from eagle3_data.storage.writer import StageWriter

DEADLINE_S = 20


def in_child(fn, deadline_s: float = DEADLINE_S):
    """Run `fn()` in a forked child; its JSON-able result, or AssertionError with the child's error.
    The child is killed at the deadline, so a hang fails the test instead of waiting."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(deadline_s) + 5)  # belt and braces: the parent kills it first
            out = {"ok": fn()}
        except BaseException as exc:
            out, code = {"error": "".join(traceback.format_exception(exc))[-3000:]}, 1
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(out, default=str))
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        raise AssertionError(f"the forked child did not finish within {deadline_s} s (hung)")
    with os.fdopen(read) as f:
        data = f.read()
    out = json.loads(data) if data else {"error": f"child died with status {status}"}
    if "error" in out:
        raise AssertionError("in the forked child:\n" + out["error"])
    return out["ok"]


def test_tiktoken_codec_pool(kimi_tokenizer):
    from eagle3_data.chat_format import get_output_format

    codec = get_output_format(kimi_tokenizer, thinking=True).codec
    texts = [f"sample {i}: the NOR gate, 中文, 😀" for i in range(64)]
    expected = codec.encode_ordinary_batch(texts)  # the pool's threads start here, in the parent
    assert in_child(lambda: codec.encode_ordinary_batch(texts)) == expected
    assert codec.encode_batch(texts) == expected  # the parent's pool is untouched


def test_hidden_state_background_writer():
    from eagle3_data.stages.hidden_states.extract import _BackgroundWriter

    writer = _BackgroundWriter(lambda samples, index: {"index": index, "pid": os.getpid()})
    writer.put([], 0)

    def child():
        for i in range(1, 5):  # more than the queue's depth: a missing thread blocks the third put
            writer.put([], i)
        return writer.close()

    results = in_child(child)
    assert [r["index"] for r in results] == [1, 2, 3, 4]
    assert {r["pid"] for r in results} != {os.getpid()}
    assert [r["index"] for r in writer.close()] == [0]


def test_part_prefetcher_resumed_in_a_child(store):
    ref = StageRef("fork", "prompts", "ds")
    with StageWriter(store, ref, "prompts", rows_per_part=3) as w:
        w.write(
            [
                {
                    "sample_id": f"s{i}",
                    "dataset": "ds",
                    "sample_index": i,
                    "messages": "[]",
                    "tools": None,
                    "route": "local",
                }
                for i in range(12)
            ]
        )
        w.commit()
    rows = store.iter_batches(ref, columns=["sample_id"], batch_size=3)
    first = next(rows).column("sample_id").to_pylist()  # part 0 read, part 1 prefetched on a thread
    assert first == ["s0", "s1", "s2"]
    rest = in_child(lambda: [sid for b in rows for sid in b.column("sample_id").to_pylist()])
    assert rest == [f"s{i}" for i in range(3, 12)]
    assert [sid for b in rows for sid in b.column("sample_id").to_pylist()] == rest  # the parent goes on too


class _RecordingProxy:
    """A loopback TCP proxy in front of the S3 server that records, per client connection, the
    request lines it carried: which process's requests shared a socket."""

    def __init__(self, target: str) -> None:
        import socket
        import threading
        from urllib.parse import urlparse

        url = urlparse(target)
        self.target = (url.hostname, url.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: dict[int, list[str]] = {}  # connection number -> request lines
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        n = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            n += 1
            upstream = socket.create_connection(self.target)
            self.requests[n] = []
            threading.Thread(target=self._pipe, args=(conn, upstream, n), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, None), daemon=True).start()

    def _pipe(self, src, dst, record: int | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    with self._lock:
                        self.requests[record] += [
                            line.decode(errors="replace")
                            for line in data.split(b"\r\n")
                            if line.startswith((b"GET ", b"PUT ", b"HEAD "))
                        ]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass


def test_boto3_client_connections_are_not_shared_with_a_child(s3_server, s3_bucket):
    """A pooled connection a child inherits is one socket for two processes, whose requests and
    answers interleave as soon as both use it at once. The child must open its own."""
    from eagle3_data.storage import ArtifactStore
    from eagle3_data.storage.client import s3_client

    s3_server.client().put_object(Bucket=s3_bucket, Key="obj", Body=b"x" * 1000)
    proxy = _RecordingProxy(s3_server.endpoint_url)
    client = s3_client(proxy.url, access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    store = ArtifactStore(client=client, bucket=s3_bucket, prefix="p")  # what a task holds

    def get(tag: str) -> bytes:
        return store.client.get_object(
            Bucket=s3_bucket, Key="obj", Range="bytes=0-9", IfMatch="*", ResponseCacheControl=tag
        )["Body"].read()

    assert get("parent-0") == b"x" * 10  # the parent's connection is pooled now
    assert in_child(lambda: [get(f"child-{i}").decode() for i in range(3)]) == ["x" * 10] * 3
    assert get("parent-1") == b"x" * 10
    shared = [
        lines
        for lines in proxy.requests.values()
        if any("parent" in line for line in lines) and any("child" in line for line in lines)
    ]
    assert not shared, f"one connection carried both processes' requests: {shared}"
    assert any(any("child" in line for line in lines) for lines in proxy.requests.values())
    proxy.listener.close()


def test_lease_renewed_by_a_child_leaves_the_parent_holding_it(store):
    ref = StageRef("fork", "generate_local", "ds")
    lease = store.lease(ref, ttl_s=4)
    try:
        lease.renew()

        def child():
            lease.renew()  # verifies, does not write: the parent's etag stays the one S3 expects
            lease.check()
            lease.release()  # ends the child's use only
            return lease.etag

        child_etag = in_child(child)
        assert child_etag == lease.etag
        time.sleep(1.5)  # at least one heartbeat of the parent after the child's renewal
        lease.renew()
        lease.check()
        holder = json.loads(store.client.get_object(Bucket=store.bucket, Key=lease.key)["Body"].read())
        assert holder["token"] == lease.token and holder["state"] == "held" and holder["pid"] == os.getpid()
    finally:
        lease.release()


def test_child_of_a_lost_lease_refuses_to_write(store):
    """The child's check reads what S3 holds: a lease the parent lost is lost for the child too."""
    ref = StageRef("fork", "generate_local", "lost")
    lease = store.lease(ref, ttl_s=60)
    lease._stop.set()  # the parent stops renewing: a takeover below stands
    store.client.put_object(
        Bucket=store.bucket,
        Key=lease.key,
        ContentType="application/json",
        Body=json.dumps({"owner": "another writer", "token": "t" * 32, "state": "held", "ttl_s": 60}).encode(),
    )

    def child():
        try:
            lease.renew()
        except LeaseLost as exc:
            return str(exc)
        return None

    message = in_child(child)
    assert message is not None and "another writer" in message
    with pytest.raises(LeaseLost, match="taken over by another writer"):
        lease.renew()
    lease.release()


def test_prompt_spill_copied_by_the_child(tmp_path):
    from eagle3_data.spill import RowSpill

    schema = pa.schema([("sample_id", pa.string()), ("n", pa.int64())])
    spill = RowSpill(schema, batch_rows=4)
    for i in range(10):  # two batches in the file, two rows buffered
        spill.append({"sample_id": f"p{i}", "n": i})

    def child():
        for i in range(3):
            spill.append({"sample_id": f"c{i}", "n": 100 + i})
        spill.drop(["p0"])
        rows = [r["sample_id"] for r in spill.rows()]
        spill.close()
        return rows

    assert in_child(child) == [f"p{i}" for i in range(1, 10)] + ["c0", "c1", "c2"]
    for i in range(10, 13):  # the parent goes on writing its own file
        spill.append({"sample_id": f"p{i}", "n": i})
    assert os.path.exists(spill.path)  # the child's exit removed nothing of the parent's
    assert [r["sample_id"] for r in spill.rows()] == [f"p{i}" for i in range(13)]
    spill.close()
    assert not os.path.exists(spill.path)


def test_generation_client_runs_in_a_child_after_the_parent_ran(store, start_dev_server, kimi_tokenizer, tmp_path):
    """The HTTP sessions and event loops of a generation stage live for one stage run: a child
    forked after a run builds its own, on the parent's store and tokenizer."""
    from tests.generation_calls import generate_local

    server = start_dev_server({})
    sampling = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 24, "thinking": True}

    def prompts(tag: str) -> list[dict]:
        return [
            {
                "sample_id": f"{tag}{i}",
                "dataset": "ds",
                "sample_index": i,
                "route": "local",
                "tools": None,
                "messages": json.dumps([{"role": "user", "content": f"{tag} question {i}"}]),
            }
            for i in range(6)
        ]

    def run(tag: str) -> int:
        ref = StageRef("fork", "generate_local", tag)
        summary = generate_local(
            store,
            ref,
            prompts(tag),
            kimi_tokenizer,
            [server.url],
            sampling,
            in_flight_per_endpoint=3,
            rows_per_part=4,
            journal_dir=tmp_path / tag,
        )
        return summary["counts"]["ok"]

    assert run("parent") == 6
    assert in_child(lambda: run("child"), deadline_s=60) == 6
    assert store.read_table(StageRef("fork", "generate_local", "child")).num_rows == 6
