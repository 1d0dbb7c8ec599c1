"""A SIGALRM handler that raises (Airflow's execution timeout) runs outside the event loop's callbacks.

Airflow bounds a task with SIGALRM, whose handler raises `AirflowTaskTimeout` in the main thread,
wherever it is. The generation clients run an event loop there. Waiting in epoll, the loop lets
the exception out; but raised inside a callback the loop was running (a response's bytes parsed
in aiohttp's protocol callback, a request's step), asyncio catches it: `Handle._run` logs any
BaseException but SystemExit and KeyboardInterrupt as "Exception in callback", and a task step
keeps it as that task's exception. The stage then goes on past its bound, or waits forever on the
future the exception broke, holding its stage's lease, with no second alarm to end it (found when
a signal handler raising in the stage left a task process waiting in epoll for minutes:
seen in a `make test` cluster run, 2026-12-05).

`with_alarm_outside_callbacks(coro)` runs `coro` with a SIGALRM handler of its own that only
notes the alarm and schedules the run's cancellation (thread-safe: it may run inside any callback,
or wake the loop from epoll); once the client's own cancellation has unwound (in-flight requests
cancelled, the writer's parts kept), the caller's handler is called where its exception reaches
the stage, as if the loop had been waiting when the alarm came.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


async def with_alarm_outside_callbacks(coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro`; a SIGALRM with a Python handler cancels it, then calls that handler."""
    handler = signal.getsignal(signal.SIGALRM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        return await coro  # no alarm to defer (no execution timeout, or no signals off the main thread)
    loop = asyncio.get_running_loop()
    run = asyncio.current_task()
    assert run is not None
    fired: list[bool] = []

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        fired.append(True)
        loop.call_soon_threadsafe(run.cancel)

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            result = await coro
        except asyncio.CancelledError:
            if not fired:
                raise
            result = None  # the alarm's cancellation, unwound by the client
    finally:
        signal.signal(signal.SIGALRM, handler)
    if fired:  # also when the client swallowed the cancellation and returned
        handler(signal.SIGALRM, None)  # raises (Airflow's AirflowTaskTimeout) here, in the run's own step
        raise asyncio.CancelledError("SIGALRM")  # a handler that did not raise: the run was cancelled all the same
    return result  # type: ignore[return-value]
