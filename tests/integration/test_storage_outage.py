"""An S3 outage mid-stage (issue 13 item 7): the writer keeps its buffer until an upload succeeds,
and what it says about the rows is true. The outage is real: a TCP relay in front of SeaweedFS
that stops forwarding."""

from __future__ import annotations

import logging
import socket
import threading
from urllib.parse import urlparse

import pytest

from eagle3_data.storage import ArtifactStore, StageRef, StorageUnavailable, s3_client
from eagle3_data.storage.writer import StageWriter

REF = StageRef("outage", "generate_local", "chat")


class Relay:
    """127.0.0.1:port -> SeaweedFS; `down()` refuses and cuts every connection, `up()` restores."""

    def __init__(self, target: str) -> None:
        url = urlparse(target)
        self.target = (url.hostname, url.port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.open = True
        self.conns: list[socket.socket] = []
        # one lock for "is it up" and the list of connections: a connection accepted while up and
        # listed after `down()` cleared the list would survive the outage
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                if not self.open:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def down(self) -> None:
        with self.lock:
            self.open = False
            conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def up(self) -> None:
        self.open = True

    def close(self) -> None:
        self.down()
        self.sock.close()


@pytest.fixture
def relayed(s3_server, s3_bucket):
    relay = Relay(s3_server.endpoint_url)
    client = s3_client(
        relay.url,
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        max_attempts=1,
        connect_timeout=1,
        read_timeout=5,
    )
    yield relay, ArtifactStore(client=client, bucket=s3_bucket, prefix="p")
    relay.close()


def rows(a: int, b: int) -> list[dict]:
    return [{"sample_id": f"s{i:03d}", "dataset": "chat", "status": "ok"} for i in range(a, b)]


def test_failed_part_upload_keeps_the_rows_buffered_until_s3_is_back(relayed):
    relay, store = relayed
    with StageWriter(store, REF, "generations", rows_per_part=4) as w:
        w.write(rows(0, 4))
        relay.down()
        w.write(rows(4, 7))
        with pytest.raises(StorageUnavailable, match="unreachable"):
            w.write(rows(7, 9))  # the 8th row fills part 1: its upload fails
        assert w._buffered == 5 and w.rows_committed == 4  # nothing dropped
        relay.up()
        w.write(rows(9, 10))  # the next write commits part 1 with every buffered row
        w.commit()
    table = store.read_table(REF).to_pylist()
    assert sorted(r["sample_id"] for r in table) == [f"s{i:03d}" for i in range(10)]


def test_outage_message_says_the_unsaved_rows_are_not_in_s3(relayed, caplog):
    relay, store = relayed
    with caplog.at_level(logging.WARNING, logger="eagle3_data.storage.writer"):
        with pytest.raises(RuntimeError, match="generation failed"):
            with StageWriter(store, REF, "generations", rows_per_part=4) as w:
                w.write(rows(0, 6))
                relay.down()
                raise RuntimeError("generation failed")
    relay.up()
    message = [r.getMessage() for r in caplog.records if "could not checkpoint" in r.getMessage()]
    assert len(message) == 1 and "2 buffered rows" in message[0] and "NOT in S3" in message[0]
    assert not any(r.exc_info for r in caplog.records)  # one line, no chained traceback
    assert len(store.committed_sample_ids(REF)) == 4  # the first part, and only it, is in S3


def test_generation_outage_keeps_answers_in_the_journal_and_resume_pays_nothing_twice(
    relayed, start_dev_server, kimi_tokenizer, tmp_path, caplog
):
    from tests.generation_calls import MODEL, generate_overflow
    from tests.integration.test_generation import SAMPLING, SECRET, prompts

    relay, store = relayed
    server = start_dev_server({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.02}}}})
    ref = StageRef("outage", "generate_overflow", "chat")
    todo = prompts(40, "chat")
    answered = lambda: sum(server.stats()["answered"].get("chat", {}).values())

    class CutAfter:  # progress sink: cut S3 once 12 answers are in
        def start(self, *a, **k): ...
        def tick(self): ...
        def close(self): ...
        def update(self, **k):
            if answered() >= 12:
                relay.down()

    args = (store, ref, todo, kimi_tokenizer, server.url + "/v1", SECRET, MODEL, {}, None)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(StorageUnavailable, match="unreachable"):
            generate_overflow(
                *args, sampling=SAMPLING, concurrency=2, rows_per_part=8, journal_dir=tmp_path, progress=CutAfter()
            )
    journal = [m for m in (r.getMessage() for r in caplog.records) if "kept in the local journal" in m]
    assert len(journal) == 1 and "on another machine they are requested (and paid) again" in journal[0]
    assert not [r for r in caplog.records if r.exc_info], "no chained tracebacks in the log"
    relay.up()
    summary = generate_overflow(*args, sampling=SAMPLING, concurrency=2, rows_per_part=8, journal_dir=tmp_path)
    assert summary["complete"] and summary["counts"]["replayed"] > 0, summary
    assert sorted(r["sample_id"] for r in store.read_table(ref).to_pylist()) == sorted(p["sample_id"] for p in todo)
    assert set(server.stats()["answered"]["chat"].values()) == {1}  # nobody paid twice
