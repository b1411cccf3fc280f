"""
Finishing a store write that must not be cut in half by cancellation.

The async driver awaits a claim, a completion or a release *shielded*
(`async_shielded`): the step runs to its end and the cancellation is
delivered at the next `async_cancel_point`, where the flow gives back
what was claimed; ``scripts/unasync.py`` drops both from the sync driver. Why:
docs/architecture.md, "Sync and async". Also here: `async_resolve` and
its sync twin `resolve`, for hooks a user may write either way (replay
authorization) and the operation's answer: async code awaits an awaitable
answer (and takes a plain one as it is), sync code refuses one instead of
taking a coroutine object for "allowed" or for a response. And
`async_checked_handler` and its twin `checked_handler`: what can
never be a handler of that driver, refused before anything is claimed.
"""

from __future__ import annotations

import asyncio
import inspect
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Awaitable, Generator
from typing import Any, TypeVar

from ._errors import ConfigurationError

__all__ = [
    "async_cancel_point",
    "async_checked_handler",
    "async_resolve",
    "async_shielded",
    "checked_handler",
    "resolve",
]

T = TypeVar("T")
H = TypeVar("H")


async def async_shielded(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile: the
    cancellation is requested again (its count kept, for ``asyncio.timeout``) once the
    step is done. The step runs in this task, which waits on a `_Shield` (no task
    made, no loop turn added); a driver's own timeout cancels a `_StepTask`."""
    result: T = await _Shield(awaitable)
    return result


class _StepTask:
    """The current task while a shielded step runs: what the step's own timeouts cancel."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.waiting: Any = None  # the future the step waits on
        self.must_cancel = False  # a cancel() the step has not received yet
        self._cancels = 0
        self.finished = False

    def cancel(self, msg: Any = None) -> bool:
        if self.finished:
            return False
        self._cancels += 1
        if self.waiting is None or not self.waiting.cancel(msg):
            self.must_cancel = True
        return True

    def cancelling(self) -> int:
        return self._cancels

    def uncancel(self) -> int:
        self._cancels = max(self._cancels - 1, 0)
        return self._cancels

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, caller: asyncio.Task[Any], resume: Any, sent: Any) -> Any:
        """``resume(sent)`` with this as the current task: what the step yields next."""
        _leave_task(self._loop, caller)
        _enter_task(self._loop, self)  # type: ignore[arg-type]  # task-like, as asyncio.timeout needs
        try:
            return resume(sent)
        finally:
            _leave_task(self._loop, self)  # type: ignore[arg-type]
            _enter_task(self._loop, caller)


class _Shield:
    """What the caller's task waits on: the step's future's wake-up, not its ``cancel()``."""

    _asyncio_future_blocking = False

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self._awaitable = awaitable
        self._step: _StepTask | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        assert self._step is not None
        return self._step.get_loop()

    def add_done_callback(self, callback: Any, *, context: Any = None) -> None:
        assert self._step is not None
        self._step.waiting.add_done_callback(callback, context=context)

    def cancel(self, msg: Any = None) -> bool:
        return False  # the caller's task keeps it as ``_must_cancel``: thrown in after the wait

    def __await__(self) -> Generator[Any, None, Any]:
        caller = asyncio.current_task()
        assert caller is not None
        cancels = caller.cancelling()
        step = self._step = _StepTask(asyncio.get_running_loop())
        inner = self._awaitable.__await__()
        resume: Any = inner.send
        sent: Any = None
        try:
            while True:
                if step.must_cancel:
                    step.must_cancel = False
                    resume, sent = inner.throw, asyncio.CancelledError()
                try:
                    waiting = step.run(caller, resume, sent)
                except StopIteration as stop:
                    return stop.value
                resume, sent = inner.send, None
                blocking = getattr(waiting, "_asyncio_future_blocking", False)
                if blocking:  # else a bare yield: the caller's task steps again soon
                    waiting._asyncio_future_blocking = False
                    self._asyncio_future_blocking = True  # the caller's task blocks on us
                    step.waiting = waiting
                try:
                    yield self if blocking else waiting
                except asyncio.CancelledError as exc:
                    if blocking and waiting.cancelled():
                        resume, sent = inner.throw, exc  # the step's own (its timeout)
                    # else: the caller's, delivered once the step is done
                except GeneratorExit:
                    inner.close()  # the caller's coroutine is closed: so is the step
                    raise
                except BaseException as exc:  # noqa: BLE001 -- the step's future's error: the step's
                    resume, sent = inner.throw, exc
                finally:
                    step.waiting = None
        finally:
            step.finished = True
            if caller.cancelling() > cancels:
                # A cancellation of the caller arrived meanwhile: raise it at its next await.
                caller.uncancel()
                caller.cancel()


async def async_cancel_point() -> None:
    """Raise a cancellation `async_shielded` deferred, before anything else runs."""
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        await asyncio.sleep(0)


async def async_resolve(answer: T | Awaitable[T]) -> T:
    """A hook's answer: awaited if the hook was a coroutine function."""
    if inspect.isawaitable(answer):
        return await answer
    return answer


def resolve(answer: T | Awaitable[T]) -> T:
    """A hook's answer in sync code, where an awaitable one is a configuration mistake."""
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()  # never awaited: say so here, not as a RuntimeWarning later
        msg = (
            "a coroutine function was given to sync code, which cannot await it: pass a "
            "plain function (or use the async API: AsyncIdempotency)"
        )
        raise ConfigurationError(msg)
    return answer


def async_checked_handler(handler: H) -> H:
    """``handler`` for async code; an ``async def`` with ``yield`` answers an async
    generator, never a response, and runs nothing: refused before the claim. (A plain
    function is fine: its answer is awaited if it is awaitable, else taken as it is.)"""
    if _defined_as(handler, inspect.isasyncgenfunction):
        raise ConfigurationError(f"{_name(handler)} is an async generator function: {_ANSWER}")
    return handler


def checked_handler(handler: H) -> H:
    """``handler`` for sync code; an ``async def`` one answers a coroutine that sync code
    cannot await (it would run nothing, and used to leave its key claimed): refused
    before the claim, with the fix."""
    if _defined_as(handler, inspect.iscoroutinefunction) or _defined_as(
        handler, inspect.isasyncgenfunction
    ):
        msg = (
            f"{_name(handler)} is an 'async def' function, which sync code cannot await: "
            "use AsyncIdempotency (or an async integration), or make it a plain function"
        )
        raise ConfigurationError(msg)
    return handler


_ANSWER = "a handler must return its Response (or an awaitable of one)"


def _defined_as(handler: object, kind: Any) -> bool:
    """Is ``handler`` (or its ``__call__``, for an object) a function of ``kind``?"""
    return bool(kind(handler) or kind(getattr(handler, "__call__", None)))  # noqa: B004


def _name(handler: object) -> str:
    return str(getattr(handler, "__qualname__", None) or repr(handler))
