"""
What the sweeper decides, sans I/O: the reconciler's answers and what each one means.

A claim older than the stale threshold belongs to a request that can no
longer be running, but its external effect may or may not have happened. A
reconciler asks the external system and answers :class:`Happened` (store and
replay this response), :class:`DidNotHappen` (give the key back) or
:class:`Unknown` (keep the record ``stale``, ask again later). The drivers
(``idemflow._async.sweeper`` and its generated sync twin) perform the store
writes these answers call for. See docs/crash-safety.md, "Reconcilers".
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

from ._downstream import downstream_key
from ._model import Intent, Policy, Record, Response, State, Verdict

__all__ = [
    "Answer",
    "AsyncStop",
    "DidNotHappen",
    "Happened",
    "Resolution",
    "Stop",
    "SweepReport",
    "Unknown",
    "downstream_keys",
    "intent_of",
    "settled_state",
]


@dataclass(frozen=True, slots=True)
class Happened:
    """The effect took place: complete the record with ``response``.

    Args:
        response: what every retry of the intent will be answered with (the
            classifier decides completed or failed_permanent, as for a live run).
        apply: writes the local business row that the crashed request never
            committed, on the connection of the sweeper's transaction
            (``apply(connection)``; a coroutine function for ``AsyncSweeper``).
            It commits together with the settled record or not at all. Needs
            the sweeper's ``transaction_factory``.
    """

    response: Response
    apply: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class DidNotHappen:
    """The effect did not take place: release the key so the next retry really runs.

    Args:
        reason: for the logs.
        apply: undoes the local traces the attempt committed before its
            external call (a ``pending`` row, say), on the connection of the
            sweeper's transaction (``apply(connection)``; a coroutine function
            for ``AsyncSweeper``). It commits together with the release, which
            then also forgets the recovery point: a retry starts afresh. Needs
            the sweeper's ``transaction_factory``.
    """

    reason: str = ""
    apply: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class Unknown:
    """The outcome cannot be established now: keep the record stale, ask again later."""

    reason: str = ""


#: What a reconciler answers.
Answer: TypeAlias = Happened | DidNotHappen | Unknown


class Resolution(enum.StrEnum):
    """How the sweeper left one stale record (the ``resolution`` label of the metric)."""

    COMPLETED = "completed"
    RELEASED = "released"
    UNKNOWN = "unknown"
    #: Changed under us (another sweeper re-marked it): not ours to resolve.
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one pass (or part of one) did, record by record.

    ``completed`` counts records settled from a reconciler's answer (completed
    or failed_permanent), ``released`` those given back, ``unknown`` those
    left stale to be retried, ``lost`` those another sweeper resolved first.
    ``retried`` counts how many of them were stale from an earlier pass.
    """

    completed: int = 0
    released: int = 0
    unknown: int = 0
    lost: int = 0
    retried: int = 0
    batches: int = 0

    def __add__(self, other: SweepReport) -> SweepReport:
        return SweepReport(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @property
    def resolved(self) -> int:
        """Records this pass handled, whatever the answer (lost ones excluded)."""
        return self.completed + self.released + self.unknown

    @classmethod
    def of(cls, resolution: Resolution, *, retried: bool) -> SweepReport:
        """One record's contribution."""
        return cls(**{resolution.value: 1, "retried": int(retried)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def intent_of(record: Record) -> Intent:
    """The intent a record stands for, for observers (no body: only its fingerprint)."""
    return Intent(
        record.principal,
        record.key,
        record.fingerprint,
        endpoint=record.endpoint,
        correlation_id=record.correlation_id,
    )


def downstream_keys(record: Record, steps: Sequence[str]) -> Mapping[str, str]:
    """``{step: key}``: the keys the crashed attempt sent (or would send) downstream."""
    return {step: downstream_key(record, step) for step in steps}


def settled_state(answer: Happened, policy: Policy) -> State | None:
    """The state a reconciled response settles the record in; None if it is not settled.

    A transient response (503, 429, …) is not an outcome: storing it would
    poison the key, so the answer is treated as unknown.
    """
    verdict = policy.verdict(answer.response)
    return None if verdict is Verdict.TRANSIENT else verdict.value


class Stop:
    """Tells a sweeper loop to end (a ``threading.Event`` whose wait is the loop's sleep)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True as soon as the stop is set."""
        return self._event.wait(timeout)


class AsyncStop:
    """:class:`Stop` for asyncio: ``set()`` from the loop, ``await wait(timeout)``."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        return True
