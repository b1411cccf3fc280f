"""
Finishing a store write that must not be cut in half by cancellation.

A claim, a completion or a release that is cancelled while it awaits may
still commit (in SQLite's worker thread, or on the server after the query was
sent); if its caller then stops, the key stays ``in_progress`` until the
sweeper. So the async driver awaits these steps *shielded*: the step runs to
its end, and the cancellation is delivered afterwards, at the next
:func:`async_cancel_point`, where the flow gives back what was claimed.

The sync driver is generated from the async one; ``scripts/unasync.py``
drops both there: a synchronous call cannot be cut in half.

Also here: :func:`async_resolve` and its sync twin :func:`resolve`, for hooks
a user may write either way (replay authorization): the async edge awaits an
awaitable answer, the sync edge refuses one instead of taking a coroutine
object for "allowed".
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import TypeVar

from ._errors import ConfigurationError

__all__ = ["async_cancel_point", "async_resolve", "async_shielded", "resolve"]

T = TypeVar("T")


async def async_shielded(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile.

    A cancellation that arrives meanwhile is requested again once the step is
    done (the cancel count is kept, so ``asyncio.timeout`` still recognises
    its own), and raises at the caller's next await.
    """
    task = asyncio.ensure_future(awaitable)
    deferred = False
    try:
        while True:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():  # the step itself was cancelled, not us
                    raise
                # Cancelled meanwhile, or as the step ended (its result is there, and
                # the next shield hands it over): deliver the cancellation afterwards.
                deferred = True
    finally:
        if deferred:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
                current.cancel()


async def async_cancel_point() -> None:
    """Raise a cancellation :func:`async_shielded` deferred, before anything else runs."""
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
        msg = "a coroutine function was given as a hook to sync code; pass a plain function"
        raise ConfigurationError(msg)
    return answer
