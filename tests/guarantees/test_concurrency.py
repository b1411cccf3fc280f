"""
``async_shielded``: a store step runs to its end whatever happens to the task awaiting it.

The drivers' claim, completion and release go through it (``tests/guarantees/test_seams.py`` and
``tests/guarantees/test_modes.py`` cancel real runs); these pin the primitive itself: a cancellation
of the caller waits for the step and is delivered after it, a timeout of the caller stays
a timeout, and a timeout *inside* the step (a driver's own ``asyncio.timeout``) still
ends the step instead of being deferred forever.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from idemflow._async.driver import async_cancel_point, async_shielded

pytestmark = pytest.mark.anyio

DEADLINE = 5.0  # seconds: every wait below is bounded by it


async def _until(condition: object) -> None:
    """Yield to the loop until ``condition()`` holds (a deadline, not a sleep)."""
    async with asyncio.timeout(DEADLINE):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0)


async def test_a_cancelled_caller_lets_the_step_finish_then_is_cancelled() -> None:
    release, started, done = asyncio.Event(), asyncio.Event(), []
    returned = []

    async def step() -> int:
        started.set()
        await release.wait()
        done.append("step")
        return 7

    async def caller() -> None:
        returned.append(await async_shielded(step()))
        await async_cancel_point()  # the deferred cancellation raises here
        done.append("after")  # never reached

    task = asyncio.create_task(caller())
    await asyncio.wait_for(started.wait(), DEADLINE)
    task.cancel()
    await _until(lambda: task.cancelling() > 0)
    assert not task.done()  # still waiting for the step
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, DEADLINE)
    assert done == ["step"]
    assert returned == [7]  # the step's result reached the caller before the cancellation


async def test_a_timeout_of_the_caller_stays_a_timeout() -> None:
    release, started, done = asyncio.Event(), asyncio.Event(), []
    loop = asyncio.get_running_loop()
    scope: list[asyncio.Timeout] = []

    async def step() -> str:
        started.set()
        await release.wait()
        done.append("step")
        return "ok"

    async def caller() -> None:
        async with asyncio.timeout(None) as timeout:
            scope.append(timeout)
            await async_shielded(step())
            await asyncio.sleep(DEADLINE)  # the deferred cancellation lands here

    task = asyncio.create_task(caller())
    await asyncio.wait_for(started.wait(), DEADLINE)
    scope[0].reschedule(loop.time())  # the caller's own timeout expires mid-step
    await _until(lambda: task.cancelling() > 0)
    release.set()
    with pytest.raises(TimeoutError):  # recognised as its own: the cancel count was kept
        await asyncio.wait_for(task, DEADLINE)
    assert done == ["step"]


async def test_a_timeout_inside_the_step_ends_the_step() -> None:
    """The step's own ``asyncio.timeout`` cancels the step, not the caller, and is not
    mistaken for the caller's cancellation (which would wait for the step forever)."""
    never = asyncio.Event()

    async def step() -> None:
        async with asyncio.timeout(0):
            await never.wait()

    async def shielded() -> None:
        await async_shielded(step())

    task = asyncio.create_task(shielded())
    try:
        await asyncio.wait({task}, timeout=DEADLINE)
        assert task.done(), "the step's timeout was deferred as if it were the caller's"
    finally:
        never.set()  # a step left waiting ends now, so the test ends either way
    assert isinstance(task.exception(), TimeoutError)
    assert task.cancelling() == 0  # nothing left pending on the caller


async def test_the_steps_result_and_exceptions_pass_through() -> None:
    async def answer() -> dict[str, int]:
        await asyncio.sleep(0)
        return {"id": 1}

    async def fail() -> None:
        await asyncio.sleep(0)
        raise LookupError("store said no")

    async def at_once() -> str:
        return "without waiting"

    assert await async_shielded(answer()) == {"id": 1}
    assert await async_shielded(at_once()) == "without waiting"
    with pytest.raises(LookupError, match="store said no"):
        await async_shielded(fail())


async def test_a_step_cancelled_on_its_own_raises_its_cancellation() -> None:
    async def step() -> None:
        current = asyncio.current_task()
        assert current is not None
        current.cancel()  # the step's own task, as a driver's shutdown would
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        await async_shielded(step())


async def test_the_step_runs_in_the_callers_task() -> None:
    """No task of its own (a task per store step was most of a request's loop turns): what
    the step sets in its context, the caller sees."""
    seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen")

    async def step() -> None:
        seen.set("set by the step")
        await asyncio.sleep(0)

    await async_shielded(step())
    assert seen.get("") == "set by the step"
