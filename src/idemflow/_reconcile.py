"""What the sweeper decides, sans I/O: a reconciler's answers and what `plan` says each
means (docs/crash-safety.md, "Reconcilers")."""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

from ._downstream import downstream_key
from ._model import Intent, Policy, Record, Response, State, Verdict


@dataclass(frozen=True, slots=True)
class Happened:
    """The effect took place: settle the record with ``response``. ``apply(connection)``
    writes what the crashed request never committed, with the record, in the sweeper's
    transaction."""

    response: Response
    apply: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class DidNotHappen:
    """The effect did not take place: release the key so the next retry really runs.
    ``apply(connection)`` undoes the attempt's local traces, with the release, in the
    sweeper's transaction."""

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
    """What one pass (or part of one) did, record by record (``retried``: those stale
    from an earlier pass; ``lost``: those another sweeper resolved first)."""

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


@dataclass(frozen=True, slots=True)
class Plan:
    """What the sweeper writes for one answer: a fenced settle (``state``) or release, in
    its transaction or not; for UNKNOWN nothing (``why``)."""

    resolution: Resolution
    state: State | None = None
    in_transaction: bool = False
    why: str = ""  # logged with the record's id


def plan(answer: Answer, policy: Policy, *, transactions: bool) -> Plan:
    """What ``answer`` means for its stale record (``transactions``: the sweeper has a
    ``transaction_factory``, without which no ``apply`` runs)."""
    if isinstance(answer, Unknown):
        return Plan(Resolution.UNKNOWN)
    if isinstance(answer, Happened):
        verdict = policy.verdict(answer.response)
        if verdict is Verdict.TRANSIENT:  # storing it would poison the key
            why = (
                f"reconciler answered Happened with transient status {answer.response.status}"
                " for record %s; a transient response is not an outcome, the record stays stale"
            )
            return Plan(Resolution.UNKNOWN, why=why)
        done = Plan(Resolution.COMPLETED, verdict.value, in_transaction=transactions)
    else:
        done = Plan(Resolution.RELEASED, in_transaction=transactions and answer.apply is not None)
    if answer.apply is not None and not transactions:
        why = (
            f"{type(answer).__name__}.apply for record %s needs the sweeper's "
            "transaction_factory; the record stays stale"
        )
        return Plan(Resolution.UNKNOWN, why=why)
    return done


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
    """`Stop` for asyncio: ``set()`` from the loop, ``await wait(timeout)``."""

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
