"""A lease that lives as long as the work: a consumer's claim renewed (the store's fenced
``renew``) every ``every`` seconds while its handler runs, until a renewal finds another owner
(``LeaseLost``): the handler, cancelled (async) or let end (sync: a thread renews), raises it
instead of answering, so the run never completes over the new owner (the completion is fenced
too) and the caller's transaction rolls back. A renewal the store cannot serve is tried again."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._errors import LeaseLost
from .._model import Clock, Record
from ..stores.protocol import AsyncStore, Store

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]

logger = logging.getLogger("idemflow")

T = TypeVar("T")


class AsyncLeaseKeeper:
    """Renews ``record``'s claim in ``store`` every ``every`` seconds while `guard` runs."""

    def __init__(self, store: AsyncStore, record: Record, every: float, clock: Clock) -> None:
        self._store, self._record, self._every, self._clock = store, record, every, clock
        self._lost: LeaseLost | None = None
        self._ended = False

    async def guard(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``'s answer; ``LeaseLost`` (``work`` cancelled) once another owns the claim."""
        task = asyncio.ensure_future(work())
        renewing = asyncio.ensure_future(self._renew_until_lost(task))
        try:
            return await task
        except asyncio.CancelledError:
            if self._lost is None or not task.cancelled():
                raise  # our own cancellation (asyncio cancelled ``task`` with us)
            raise self._lost from None
        finally:
            # A cancellation that arrives as a shielded renewal ends is deferred, and may be
            # lost (seen under load: the renewals went on, this wait never ended): the flag
            # ends the loop at its next turn whatever becomes of the cancellation.
            self._ended = True
            renewing.cancel()
            # Ended before the completion: a renewal still in flight would race it.
            await asyncio.wait([renewing])

    async def _renew_until_lost(self, task: asyncio.Future[Any]) -> None:
        while True:
            await asyncio.sleep(self._every)
            if self._ended:
                return
            try:
                await self._store.renew(self._record, self._clock())
            except LeaseLost as lost:
                self._lost = lost
                task.cancel()
                return
            except Exception:
                logger.warning("could not renew a claim; trying again", exc_info=True)


class LeaseKeeper:
    """`AsyncLeaseKeeper` for sync handlers: a thread renews the claim."""

    def __init__(self, store: Store, record: Record, every: float, clock: Clock) -> None:
        self._store, self._record, self._every, self._clock = store, record, every, clock
        self._lost: LeaseLost | None = None
        self._done = threading.Event()

    def guard(self, work: Callable[[], T]) -> T:
        """``work()``'s answer; ``LeaseLost`` instead if another took the claim meanwhile."""
        renewing = threading.Thread(target=self._renew_until_lost, daemon=True)
        renewing.start()
        try:
            answer = work()
        finally:
            self._done.set()
            renewing.join()
        if self._lost is not None:
            raise self._lost
        return answer

    def _renew_until_lost(self) -> None:
        while not self._done.wait(self._every):
            try:
                self._store.renew(self._record, self._clock())
            except LeaseLost as lost:
                self._lost = lost
                return
            except Exception:
                logger.warning("could not renew a claim; trying again", exc_info=True)
