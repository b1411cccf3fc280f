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
import sys
from collections.abc import Awaitable
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
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile.

    A cancellation that arrives meanwhile is requested again once the step is
    done (the cancel count is kept, so ``asyncio.timeout`` still recognises
    its own), and raises at the caller's next await.

    The step runs in a task of its own, so a timeout inside it (a driver's
    ``asyncio.timeout``) cancels the step and not this task. This task waits
    on a future it cannot cancel (`_Unstoppable`) which the step
    settles itself: one loop turn less than ``asyncio.shield`` (no relay
    callback), and none at all on Python 3.12+ when the step ends without
    waiting (its task starts eagerly).
    """
    loop = asyncio.get_running_loop()
    settled = _Unstoppable(loop=loop)
    # ``loop=`` is needed: an eager Task made without it raises AttributeError (3.12.1, 3.13.0).
    step = asyncio.Task(_settle(awaitable, settled), loop=loop, **_EAGER)
    deferred = False
    try:
        while True:
            try:
                done, value = await settled
            except asyncio.CancelledError:
                # Thrown in by this task's cancel(), which could not cancel
                # ``settled``: it is delivered once the step has ended.
                deferred = True
                if not settled.done():  # pragma: no cover -- woken only by ``settled``
                    continue
                done, value = settled.result()
            break
    finally:
        if deferred:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
                current.cancel()
    del step  # held until here: the loop keeps only a weak reference to a task
    if done:
        result: T = value
        return result
    raise value


class _Unstoppable(asyncio.Future[tuple[bool, Any]]):
    """A future whose ``cancel()`` does nothing: a task cancelled while it waits on one
    gets its ``CancelledError`` when the future is done, not before."""

    def cancel(self, msg: Any = None) -> bool:
        return False


async def _settle(awaitable: Awaitable[Any], settled: _Unstoppable) -> None:
    """Run the step; hand its result (or exception, its own cancellation too) to ``settled``."""
    try:
        value = await awaitable
    except BaseException as exc:
        settled.set_result((False, exc))
        if not isinstance(exc, Exception | asyncio.CancelledError):
            raise  # KeyboardInterrupt, SystemExit: the loop must see them
    else:
        settled.set_result((True, value))


# Python 3.12+: the step runs at once, up to its first wait, without a loop turn.
_EAGER: dict[str, Any] = {"eager_start": True} if sys.version_info >= (3, 12) else {}


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
