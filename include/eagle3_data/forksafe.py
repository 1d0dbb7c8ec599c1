"""Objects that own threads, pools or connections, rebuilt in a process forked after their use.

Airflow runs every task in a process forked from a warm parent (a Celery worker after its
warm-up, the LocalExecutor), and `validate` forks its workers. A fork copies the parent's memory
but only the thread that forked: a thread pool built before the fork is in the child without a
single thread (its first `map` waits forever: the first `make cluster` on a new machine hung so in
`reconstruct`), a writer thread's queue has no consumer, and a pooled HTTP connection is one
socket shared by two processes whose requests and answers interleave. So each such object keeps
what it built per process and builds it again when it finds itself in another one (`PerProcess`),
or drops what it inherited at the fork (`at_fork_in_child`). The parent's copy is never touched
from the child: only the child's own references are replaced.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """A value built on first use in each process; in a forked child, `get()` builds a new one.

    `discard` is called on a value of this process when `reset()` drops it (a pool's shutdown);
    an inherited value is only forgotten: its threads are not in this process, and its sockets and
    files are the parent's to close.
    """

    def __init__(self, build: Callable[[], T], discard: Callable[[T], None] | None = None) -> None:
        self._build, self._discard = build, discard
        self._value: T | None = None
        self._pid: int | None = None

    def get(self) -> T:
        if self._pid != os.getpid():
            self._value, self._pid = self._build(), os.getpid()
        return self._value  # type: ignore[return-value]

    def inherited(self) -> bool:
        """True when a value was built, but by another process (the parent of a fork)."""
        return self._pid is not None and self._pid != os.getpid()

    def reset(self) -> None:
        """Drop this process's value (the next `get()` builds one again)."""
        value, ours = self._value, self._pid == os.getpid()
        self._value, self._pid = None, None
        if ours and value is not None and self._discard is not None:
            self._discard(value)


def at_fork_in_child(obj: object, reset: Callable[[object], None]) -> None:
    """Call `reset(obj)` in every process forked while `obj` is alive, before the child's code
    runs on (for objects shared by reference, which a child cannot swap for a new one: a boto3
    client held by a store, a hook and a lease). Weakly held: registering keeps nothing alive."""
    try:
        _CHILD_RESETS[obj] = reset
    except TypeError:  # not weakly referenceable (a test double): nothing of a process to drop
        pass


_CHILD_RESETS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()


def _reset_in_child() -> None:
    for obj, reset in list(_CHILD_RESETS.items()):
        reset(obj)


os.register_at_fork(after_in_child=_reset_in_child)
