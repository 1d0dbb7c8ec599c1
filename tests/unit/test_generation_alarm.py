"""stages/generate/alarm.py: an execution timeout (a SIGALRM handler that raises, as Airflow's does)
reaches the stage however busy the generation client's event loop is.

The oracle for the hazard is asyncio itself: the first test shows that without the wrapper a
handler's exception raised inside a loop callback is swallowed (the run waits on until its own
bound), so the others can fail."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import uvloop

from eagle3_data.stages.generate.alarm import with_alarm_outside_callbacks


class TaskTimeout(BaseException):
    """Airflow's AirflowTaskTimeout is a BaseException raised by its SIGALRM handler."""


def raise_timeout(signum, frame) -> None:
    raise TaskTimeout("the task's execution_timeout")


async def one_busy_callback(busy_s: float, bound_s: float = 3.0) -> str:
    """The loop inside one callback for `busy_s` (as the client parsing a response in aiohttp's
    protocol callback); the run ends when it has, or at `bound_s` with TimeoutError."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def spin() -> None:
        end = time.monotonic() + busy_s
        while time.monotonic() < end:
            pass
        done.set_result("finished")

    loop.call_soon(spin)
    return await asyncio.wait_for(done, bound_s)


def run_with_alarm(coro, after_s: float, runner=asyncio.run):
    previous = signal.signal(signal.SIGALRM, raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, after_s)
    try:
        return runner(coro)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_without_the_wrapper_asyncio_swallows_the_timeout_raised_in_a_callback():
    with pytest.raises(asyncio.TimeoutError):  # the callback's future was never set: the run waited on
        run_with_alarm(one_busy_callback(0.5, bound_s=1.5), after_s=0.1)


@pytest.mark.parametrize("runner", ["asyncio", "uvloop"])  # the local and the overflow client's loops
def test_a_timeout_raised_in_a_callback_reaches_the_caller(runner):
    run = asyncio.run if runner == "asyncio" else uvloop.run
    with pytest.raises(TaskTimeout, match="execution_timeout"):
        run_with_alarm(with_alarm_outside_callbacks(one_busy_callback(0.5)), after_s=0.1, runner=run)


def test_a_timeout_while_the_loop_waits_reaches_the_caller():
    with pytest.raises(TaskTimeout):
        run_with_alarm(with_alarm_outside_callbacks(asyncio.sleep(30)), after_s=0.1)


def test_a_client_that_swallows_its_cancellation_still_times_out():
    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "returned anyway"
        return "slept"

    with pytest.raises(TaskTimeout):
        run_with_alarm(with_alarm_outside_callbacks(stubborn()), after_s=0.1)


def test_without_an_alarm_the_result_comes_back_and_the_handler_is_the_callers():
    previous = signal.signal(signal.SIGALRM, raise_timeout)
    try:
        assert asyncio.run(with_alarm_outside_callbacks(asyncio.sleep(0, result="done"))) == "done"
        assert signal.getsignal(signal.SIGALRM) is raise_timeout
    finally:
        signal.signal(signal.SIGALRM, previous)
