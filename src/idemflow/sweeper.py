"""The stale-claim sweeper: a [`Sweeper`][idemflow.sweeper.Sweeper] marks a crashed request's
claim ``stale`` past ``policy.stale_after`` and resolves it exactly once, asking a
``reconciler`` where the effect went outside. How to run it: docs/crash-safety.md."""

from __future__ import annotations

import asyncio
import threading
from typing import overload

# Not listed, but here for the layers above (the CLI): the loop's parts, a pass's report.
from ._async.sweeper import DEFAULT_BATCH_SIZE as DEFAULT_BATCH_SIZE  # noqa: PLC0414
from ._async.sweeper import AsyncSweeper
from ._deprecation import moved
from ._model import Duration
from ._reconcile import Answer, DidNotHappen, Happened, Unknown
from ._reconcile import AsyncStop as AsyncStop  # noqa: PLC0414
from ._reconcile import Stop as Stop  # noqa: PLC0414
from ._reconcile import SweepReport as SweepReport  # noqa: PLC0414
from ._sync.sweeper import Reconciler as Reconciler  # noqa: PLC0414
from ._sync.sweeper import Sweeper

__all__ = [
    "Answer",
    "AsyncBackgroundSweeper",
    "AsyncSweeper",
    "DidNotHappen",
    "Happened",
    "Sweeper",
    "Unknown",
    "start_background_sweeper",
]


class BackgroundSweeper:
    """A [`Sweeper`][idemflow.sweeper.Sweeper] looping in a daemon thread; `stop` ends it."""

    def __init__(self, sweeper: Sweeper, every: Duration | None) -> None:
        self.sweeper = sweeper
        self._stop = Stop()
        self._thread = threading.Thread(
            target=sweeper.run_forever,
            args=(every,),
            kwargs={"stop": self._stop},
            name="idemflow-sweeper",
            daemon=True,  # never keeps a process alive that is shutting down
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current pass (if any) and wait up to ``timeout`` seconds for it."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundSweeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class AsyncBackgroundSweeper:
    """An `AsyncSweeper` looping in an asyncio task; ``await stop()`` ends it."""

    def __init__(self, sweeper: AsyncSweeper, every: Duration | None) -> None:
        self.sweeper = sweeper
        self._stop = AsyncStop()
        self.task = asyncio.get_running_loop().create_task(
            sweeper.run_forever(every, stop=self._stop), name="idemflow-sweeper"
        )

    @property
    def running(self) -> bool:
        return not self.task.done()

    async def stop(self) -> None:
        """Stop after the current pass (if any) and wait for the task to end."""
        self._stop.set()
        await self.task

    async def __aenter__(self) -> AsyncBackgroundSweeper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


@overload
def start_background_sweeper(
    sweeper: Sweeper, *, every: Duration | None = None
) -> BackgroundSweeper: ...


@overload
def start_background_sweeper(
    sweeper: AsyncSweeper, *, every: Duration | None = None
) -> AsyncBackgroundSweeper: ...


def start_background_sweeper(
    sweeper: Sweeper | AsyncSweeper, *, every: Duration | None = None
) -> BackgroundSweeper | AsyncBackgroundSweeper:
    """Run ``sweeper``'s `run_forever` in the background: a `Sweeper`
    in a daemon thread, an `AsyncSweeper` in a task of the running loop (call it
    from inside, e.g. a lifespan handler). Every process of an app may run one."""
    if isinstance(sweeper, AsyncSweeper):
        return AsyncBackgroundSweeper(sweeper, every)
    return BackgroundSweeper(sweeper, every)


__getattr__ = moved(
    __name__,
    {
        "AsyncReconciler": "idemflow._async.sweeper:AsyncReconciler",
        "Resolution": "idemflow._reconcile:Resolution",
    },
)
