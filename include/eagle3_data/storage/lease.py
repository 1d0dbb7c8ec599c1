"""One writer per stage: a lease object taken and renewed with S3 conditional writes.

Two writers on one stage (an Airflow zombie and its retry, a manual run racing a scheduled one)
would both pay for every sample and overwrite each other's parts. So a writer first takes
`{stage}/_lease.json`:

- create with `If-None-Match: *`: of any number of racing writers exactly one gets 200, the
  others 412 (AWS S3 since 2024-08, SeaweedFS 4.x; proven by tests/integration/test_lease.py);
- renew (heartbeat, every `ttl_s / 4`) and release with `If-Match: <etag of our last write>`: a
  writer whose lease was taken over learns it on its next renewal and stops before writing more;
- an expired or released lease is taken over with `If-Match: <etag we read>`, so of two writers
  racing for a dead holder's lease, one wins (the server checks the etag and writes as one step:
  AWS S3 since 2024-11, SeaweedFS under its per-object write lock; 16 racing overwrites are tested).

A holder on this host whose process is gone is taken over at once. Threads of one process share a
pid, so for them "dead" means "token not registered live here": a writer registers its token
before its first PUT, or a racing thread could read its fresh record, judge it dead and take over.

Expiry is judged on the S3 server's clock (the lease object's Last-Modified against the Date of
the response that read it), never by comparing the clocks of two workers.
Release writes a `released` record rather than deleting: AWS general-purpose buckets honour
`If-Match` on PUT everywhere, and a conditional PUT is all this protocol needs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from eagle3_data.storage.client import NOT_FOUND, error_code, s3_errors
from eagle3_data.storage.refs import StageRef, StorageError

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

log = logging.getLogger(__name__)

LEASE = "_lease.json"
DEFAULT_TTL_S = 120.0
_CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_LIVE_TOKENS: set[str] = set()  # leases this process holds and has not released


class StageBusy(StorageError):
    """Another writer holds the stage's lease."""


class LeaseLost(StorageError):
    """This writer's lease was taken over (or could not be renewed in time): it must stop writing."""


def default_owner() -> str:
    """Who holds a lease, for the message another writer sees: host, pid, and a random tag."""
    label = os.environ.get("EAGLE3_LEASE_OWNER")
    if not label and os.environ.get("AIRFLOW_CTX_TASK_ID"):  # Airflow exports these to every task process
        env = os.environ
        label = (
            f"Airflow {env.get('AIRFLOW_CTX_DAG_ID', '?')}.{env['AIRFLOW_CTX_TASK_ID']} run "
            f"{env.get('AIRFLOW_CTX_DAG_RUN_ID', '?')} try {env.get('AIRFLOW_CTX_TRY_NUMBER', '?')}"
        )
    base = f"{socket.gethostname()}:pid {os.getpid()}"
    return f"{label} ({base})" if label else base


def _server_now(response: dict[str, Any]) -> datetime:
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date) if date else datetime.now(timezone.utc)
    except (TypeError, ValueError):
        return datetime.now(timezone.utc)


class Lease:
    """A held lease. Use `acquire_lease(...)`; `check()` before every write, `release()` at the end."""

    def __init__(
        self, store: ArtifactStore, ref: StageRef, owner: str, token: str, ttl_s: float, scope: str | None = None
    ):
        self.store, self.ref, self.owner, self.token, self.ttl_s = store, ref, owner, token, ttl_s
        self.scope = scope  # None: the whole stage; else one unit of it (a shard), leased on its own
        self.etag = ""  # the lease object's, once written
        self.took_over: dict | None = None  # the expired holder's record when this lease was taken over
        self._renewed = time.monotonic()
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder_pid = os.getpid()  # the process that took it: only it writes the lease object

    @property
    def name(self) -> str:
        return lease_name(self.scope)

    @property
    def key(self) -> str:
        return self.store.key(self.ref, self.name)

    @property
    def subject(self) -> str:
        """What is leased, for messages: the stage URI, plus the unit for a scoped lease."""
        return self.store.uri(self.ref) + (f" (shard {self.scope})" if self.scope else "")

    def _body(self, state: str) -> bytes:
        now = datetime.now(timezone.utc)
        return json.dumps(
            {
                "owner": self.owner,
                "token": self.token,
                "state": state,
                "ttl_s": self.ttl_s,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat_at": now.isoformat(timespec="seconds"),
                "expires_at": (now + timedelta(seconds=self.ttl_s)).isoformat(timespec="seconds"),
            },
            sort_keys=True,
        ).encode()

    def _put(self, state: str) -> None:
        with self._lock:
            if self._lost:
                raise LeaseLost(self._lost)
            try:
                with s3_errors(self.store.client, f"renewing the lease {self.store.uri(self.ref, self.name)}"):
                    resp = self.store.client.put_object(
                        Bucket=self.store.bucket,
                        Key=self.key,
                        Body=self._body(state),
                        IfMatch=self.etag,
                        ContentType="application/json",
                    )
            except ClientError as exc:
                if error_code(exc) in _CONFLICT:
                    self._lost = f"{self.subject}: {self._replaced_by()}; this writer stopped before writing more"
                    raise LeaseLost(self._lost) from None
                raise
            self.etag = resp["ETag"]
            self._renewed = time.monotonic()

    def _replaced_by(self) -> str:
        """What a refused renewal found: who holds the lease object now (read, never assumed)."""
        try:
            with s3_errors(self.store.client, f"reading the lease {self.store.uri(self.ref, self.name)}"):
                current = self.store.client.get_object(Bucket=self.store.bucket, Key=self.key)
            holder = json.loads(current["Body"].read() or b"{}")
        except Exception as exc:
            return f"the lease object changed since this writer's last renewal (unreadable now: {exc})"
        if holder.get("token") == self.token:
            return f"the lease object was rewritten under this writer's own token by pid {holder.get('pid')}"
        return (
            f"the lease was taken over by {holder.get('owner', '?')} (lease {str(holder.get('token', '?'))[:8]}, "
            f"{holder.get('state', '?')}, last heartbeat {holder.get('heartbeat_at', '?')}; this writer's last "
            f"renewal was {time.monotonic() - self._renewed:.0f} s ago, its ttl {self.ttl_s:.0f} s)"
        )

    def _forked(self) -> bool:
        """In a child forked while the lease was held: the parent holds it and renews it (its etag
        is the one S3 expects); the child writing it would make the parent's next renewal fail."""
        return os.getpid() != self._holder_pid

    def renew(self) -> None:
        """Extend the lease now; LeaseLost if someone else holds it. In a forked child: verify,
        without writing, that the parent still holds it."""
        if self._forked():
            self._verify_held()
        else:
            self._put("held")

    def check(self) -> None:
        """Refuse to write when the lease is lost, or when it may have expired because heartbeats
        failed (S3 unreachable): renew synchronously before trusting it again."""
        if self._lost:
            raise LeaseLost(self._lost)
        if time.monotonic() - self._renewed > self.ttl_s / (4 if self._forked() else 2):
            self.renew()

    def _verify_held(self) -> None:
        """A forked child's renewal: read the lease object; it must still carry this lease's token,
        held and unexpired on the server's clock."""
        with s3_errors(self.store.client, f"reading the lease {self.store.uri(self.ref, self.name)}"):
            try:
                current = self.store.client.get_object(Bucket=self.store.bucket, Key=self.key)
            except ClientError as exc:
                if error_code(exc) not in NOT_FOUND:
                    raise
                current = None
        holder = json.loads(current["Body"].read() or b"{}") if current is not None else {}
        if holder.get("token") != self.token or holder.get("state") != "held":
            self._lost = (
                f"{self.subject}: the lease this process inherited from pid {self._holder_pid} is no longer "
                f"held by it (now: {holder.get('owner', 'nobody')}, {holder.get('state', 'absent')}); "
                "stopped before writing more"
            )
            raise LeaseLost(self._lost)
        expires = current["LastModified"] + timedelta(seconds=float(holder.get("ttl_s", self.ttl_s)))
        if _server_now(current) >= expires:
            self._lost = (
                f"{self.subject}: the lease this process inherited from pid {self._holder_pid} expired at "
                f"{expires.isoformat(timespec='seconds')} (its holder stopped renewing it); stopped before writing more"
            )
            raise LeaseLost(self._lost)
        self._renewed = time.monotonic()

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.ref.dataset}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost:
                log.error("%s", self._lost)
                return
            except Exception as exc:  # S3 blip: the next beat retries; check() renews before any write
                log.warning("lease heartbeat for %s failed: %s", self.store.uri(self.ref), exc)

    def release(self) -> None:
        """Mark the lease released (best effort: an unreachable S3 lets it expire instead). In a
        forked child only the child's use of it ends: the parent still holds it."""
        if self._forked():
            self._lost = self._lost or f"{self.subject}: released by this process (its parent still holds it)"
            return
        self._stop.set()
        _LIVE_TOKENS.discard(self.token)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._lost:
            return
        try:
            self._put("released")
        except Exception as exc:
            log.warning(
                "could not release the lease %s (%s); it expires in %.0f s",
                self.store.uri(self.ref, self.name),
                exc,
                self.ttl_s,
            )
        self._lost = "released"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder_dead(holder: dict[str, Any]) -> bool:
    """A holder on this host whose process is gone (a killed CLI run, a SIGKILLed test worker)
    can be taken over at once; on another host only expiry says it is dead."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():  # this process: dead only if no live Lease object holds it
        return holder.get("token") not in _LIVE_TOKENS
    return has_exited(holder["pid"])


def has_exited(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped (`is_zombie`); a process
    this one may not signal is taken for running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return is_zombie(pid)


def is_zombie(pid: int) -> bool:
    """An exited process nobody has reaped yet: kill(pid, 0) still finds it, but it runs nothing and
    renews no lease. A SIGKILLed worker leaves its task process so wherever PID 1 does not reap
    orphans (this project's sandboxes; a container without an init): taken for alive, its lease
    would refuse the retry until its ttl ran out (seen in a `make test`
    cluster run, 2026-12-05). False where /proc cannot tell (macOS)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def lease_name(scope: str | None = None) -> str:
    """The lease object's name in the stage: `_lease.json`, or `_lease.{scope}.json` for one unit
    (a hidden-state shard: parallel workers on one stage lease their shards, not the stage)."""
    return LEASE if scope is None else f"_lease.{scope}.json"


def is_lease(name: str) -> bool:
    """A lease object (stage or scoped): not an artifact; `delete` keeps it, listings skip it."""
    return name.startswith("_lease") and name.endswith(".json")


def acquire_lease(
    store,
    ref: StageRef,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    owner: str | None = None,
    heartbeat: bool = True,
    scope: str | None = None,
) -> Lease:
    """Take the stage's lease (or, with `scope`, the lease of one unit of it) or raise StageBusy
    naming the holder and when its lease expires."""
    owner = owner or default_owner()
    token = uuid.uuid4().hex
    lease = Lease(store, ref, owner, token, ttl_s, scope=scope)
    client, bucket, key = store.client, store.bucket, lease.key
    uri = store.uri(ref, lease.name)
    store.check_bucket()  # SeaweedFS creates a missing bucket on PUT (AWS refuses): a lease must not do a setup step
    # Live before any write that could make us the holder: a thread of this process that reads our
    # record between our PUT and our return must see a live holder, not a dead pid-twin to take over.
    _LIVE_TOKENS.add(token)
    try:
        _acquire(lease, client, bucket, key, uri, ttl_s)
    except BaseException:
        _LIVE_TOKENS.discard(token)
        raise
    if heartbeat:
        lease.start_heartbeat()
    return lease


def _acquire(lease: Lease, client, bucket: str, key: str, uri: str, ttl_s: float) -> None:
    """Create the lease object, or take over an expired/released/dead holder's with If-Match."""
    for _ in range(5):  # create; or read the holder and take over if expired; a lost race reads again
        with s3_errors(client, f"taking the lease {uri}"):
            try:
                resp = client.put_object(
                    Bucket=bucket, Key=key, Body=lease._body("held"), IfNoneMatch="*", ContentType="application/json"
                )
                lease.etag = resp["ETag"]
                break
            except ClientError as exc:
                if error_code(exc) not in _CONFLICT:
                    raise
            try:
                current = client.get_object(Bucket=bucket, Key=key)
            except ClientError as exc:
                if error_code(exc) in NOT_FOUND:
                    continue  # released and deleted in between: try to create again
                raise
            holder = json.loads(current["Body"].read() or b"{}")
            _refuse_if_live(lease.subject, holder, current, ttl_s)
            try:
                resp = client.put_object(
                    Bucket=bucket,
                    Key=key,
                    Body=lease._body("held"),
                    IfMatch=current["ETag"],
                    ContentType="application/json",
                )
            except ClientError as exc:
                if error_code(exc) in _CONFLICT:
                    continue  # another writer took it over first: read who
                raise
            lease.etag = resp["ETag"]
            if holder.get("state") != "released":
                lease.took_over = holder
                log.warning(
                    "%s: took over the expired lease of %s (last heartbeat %s); committed parts are re-verified",
                    lease.subject,
                    holder.get("owner"),
                    holder.get("heartbeat_at"),
                )
            break
    else:
        raise StageBusy(f"{lease.subject}: could not take the lease after 5 tries (other writers keep taking it)")


def _refuse_if_live(subject: str, holder: dict[str, Any], current: dict[str, Any], ttl_s: float) -> None:
    """StageBusy naming the holder and its expiry, unless its lease is released, expired or dead."""
    now = _server_now(current)
    expires = current["LastModified"] + timedelta(seconds=float(holder.get("ttl_s", ttl_s)))
    if holder.get("state") != "released" and now < expires and not _holder_dead(holder):
        left = (expires - now).total_seconds()
        raise StageBusy(
            f"{subject} is being written by {holder.get('owner', '?')} (lease "
            f"{holder.get('token', '?')[:8]}, last heartbeat {holder.get('heartbeat_at', '?')}, expires "
            f"{expires.isoformat(timespec='seconds')}, in {left:.0f} s): refusing a second writer, nothing was "
            f"requested or written. Wait for it to finish; if that process is dead, retry after the expiry"
        )


def refuse_if_busy(store, ref: StageRef, *, ttl_s: float = DEFAULT_TTL_S) -> None:
    """Fail fast, before a command spends seconds loading its tokenizer, when a live writer holds
    the stage's lease. Only an early refusal: what excludes a second writer is `acquire_lease`,
    which the stage's writer still takes (a writer that starts after this check is caught there)."""
    uri = store.uri(ref, LEASE)
    with s3_errors(store.client, f"reading the lease {uri}"):
        try:
            current = store.client.get_object(Bucket=store.bucket, Key=store.key(ref, LEASE))
        except ClientError as exc:
            if error_code(exc) in NOT_FOUND:
                return
            raise
    _refuse_if_live(store.uri(ref), json.loads(current["Body"].read() or b"{}"), current, ttl_s)
