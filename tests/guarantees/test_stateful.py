"""
The store and the flow against a reference model, under random interleavings.

A Hypothesis state machine claims, completes, releases, checkpoints, sweeps
and purges keys from small pools of principals, keys and fingerprints, runs
whole requests through ``Idempotency.run`` with random outcomes, and moves a
frozen clock (sometimes past retention). After every step each record the
store holds must equal the model's: the claim is owned exactly when the model
says the key is free, owner writes fail with ``LeaseLost`` exactly when the
model says the lease is gone, replays equal the stored responses, settled or
released records past retention behave as absent, and a claim in flight is
never taken over however old it is. The same machine runs on the memory store and on
SQLite, so the reference store and the real one are held to one model.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from idemflow import (
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Policy,
    Record,
    Response,
    State,
)
from idemflow._model import retry_after
from idemflow.stores.memory import MemoryStore
from idemflow.stores.sqlite import SQLiteStore
from idemflow.testing import FrozenClock
from idemflow.transactions import SQLite3Transaction

#: request_timeout 1 s → stale after 12 s; retention 60 s.
POLICY = Policy(request_timeout=1, retention=60)
PRINCIPALS = ("alice", "bob")
KEYS = ("k1", "k2", "k3")
FINGERPRINTS = ("fp-a", "fp-b")
RESPONSES = (
    Response(201, b"created", (("location", "/p/1"),)),
    Response(200, b"\x00\xff binary"),
    Response(402, b'{"error":"declined"}', (("content-type", "application/json"),)),
)
SETTLED = (State.COMPLETED, State.FAILED_PERMANENT)

principals = st.sampled_from(PRINCIPALS)
keys = st.sampled_from(KEYS)
fingerprints = st.sampled_from(FINGERPRINTS)


def slot_label(slot: Slot | None, now: int) -> str:
    if slot is None:
        return "absent"
    return "expired" if past_retention(slot, now) else slot.state.value


def past_retention(slot: Slot, now: int) -> bool:
    """Settled, or released with nothing to reconcile, and its retention over; never a
    claim in flight or swept, nor a released one past a recovery point."""
    if slot.expires_at > now:
        return False
    if slot.state is State.RELEASED:
        return slot.recovery_point is None
    return slot.state in SETTLED


def ms(seconds: float) -> int:
    """The stores' resolution: integer milliseconds."""
    return round(seconds * 1000)


@dataclass(frozen=True)
class Slot:
    """What the model says the store holds for one (principal, key)."""

    state: State
    fingerprint: str
    #: The owner's lease token; None when ``Idempotency.run`` chose it (never held here).
    lease: str | None
    created_at: int
    updated_at: int
    expires_at: int
    response: Response | None = None
    recovery_point: str | None = None
    attempt: int = 1


class Boom(Exception):
    """A handler's own exception, which must come out of ``run`` unchanged."""


class IdempotencyMachine(RuleBasedStateMachine):
    """Drives a store (set by subclasses) and the reference model side by side."""

    held = Bundle("held")  # records of claims this machine owned (maybe no longer)
    marked = Bundle("marked")  # records a sweep marked stale

    def __init__(self) -> None:
        super().__init__()
        self.clock = FrozenClock()
        self.workdir = Path(tempfile.mkdtemp(prefix="idemflow-stateful-"))
        self.store, self.transaction = self.open_store(self.workdir)
        self.model: dict[tuple[str, str], Slot] = {}
        self.leases = itertools.count()

    def open_store(self, workdir: Path) -> tuple[Any, Any]:
        """The store under test and the caller's transaction for ``run`` (or None)."""
        raise NotImplementedError

    def teardown(self) -> None:
        if self.transaction is not None:
            self.transaction.connection.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- the model's decisions -----------------------------------------------------

    def now(self) -> int:
        return ms(self.clock())

    def free_for(self, slot: Slot | None, fingerprint: str) -> bool:
        """Absent, past retention, or released by a transient failure of the same request."""
        return (
            slot is None
            or past_retention(slot, self.now())
            or (slot.state is State.RELEASED and slot.fingerprint == fingerprint)
        )

    def claimed(
        self, slot: Slot | None, fingerprint: str, lease: str | None, retention: float
    ) -> Slot:
        """The model after a successful claim: an expired record starts over."""
        now = self.now()
        retry = (
            slot is not None and slot.state is State.RELEASED and slot.fingerprint == fingerprint
        )
        fresh = slot is None or (past_retention(slot, now) and not retry)
        return Slot(
            state=State.IN_PROGRESS,
            fingerprint=fingerprint,
            lease=lease,
            created_at=now if fresh or slot is None else slot.created_at,
            updated_at=now,
            expires_at=now + ms(retention),
            recovery_point=None if fresh or slot is None else slot.recovery_point,
            attempt=1 if fresh or slot is None else slot.attempt + 1,
        )

    def owns(self, record: Record) -> bool:
        """Is ``record``'s claim still the live one? (lease tokens are never reused)"""
        slot = self.model.get((record.principal, record.key))
        return (
            slot is not None
            and slot.lease == record.lease_token
            and slot.state is State.IN_PROGRESS
        )

    def update(self, record: Record, **changes: Any) -> None:
        slot = (record.principal, record.key)
        self.model[slot] = dataclasses.replace(self.model[slot], updated_at=self.now(), **changes)

    # --- store operations ------------------------------------------------------------

    @rule(
        target=held,
        principal=principals,
        key=keys,
        fingerprint=fingerprints,
        retention=st.sampled_from([20, 60]),
    )
    def claim(self, principal: str, key: str, fingerprint: str, retention: float) -> Any:
        slot = self.model.get((principal, key))
        lease = f"lease-{next(self.leases)}"
        now = self.clock()

        claim = self.store.claim(
            Intent(principal, key, fingerprint),
            lease,
            now,
            now + retention,
            stale_after=POLICY.stale_seconds,
        )

        assert claim.owned == self.free_for(slot, fingerprint)
        event(f"claim: {'owned' if claim.owned else 'taken'} over {slot_label(slot, self.now())}")
        if not claim.owned:
            assert slot is not None
            self.assert_matches(claim.record, slot)
            return multiple()
        self.model[principal, key] = self.claimed(slot, fingerprint, lease, retention)
        self.assert_matches(claim.record, self.model[principal, key])
        return claim.record

    @rule(
        record=held,
        state=st.sampled_from(SETTLED),
        response=st.sampled_from(RESPONSES),
    )
    def complete(self, record: Record, state: State, response: Response) -> None:
        owned = self.owns(record)
        try:
            self.store.complete(record, state, response, self.clock(), self.clock() + 3600)
        except LeaseLost:
            assert not owned, "LeaseLost although the claim is still ours"
            event("complete: lease lost")
            return
        assert owned, "completed a claim whose lease is gone"
        event("complete: settled")
        self.update(record, state=state, response=response, expires_at=self.now() + 3_600_000)

    @rule(record=held)
    def release(self, record: Record) -> None:
        owned = self.owns(record)

        assert self.store.release(record, self.clock()) is owned
        event(f"release: {'ours' if owned else 'lease gone'}")
        if owned:
            self.update(record, state=State.RELEASED)

    @rule(record=held, point=st.sampled_from(["charged", "shipped"]))
    def checkpoint(self, record: Record, point: str) -> None:
        owned = self.owns(record)
        try:
            self.store.checkpoint(record, point, self.clock())
        except LeaseLost:
            assert not owned, "LeaseLost although the claim is still ours"
            return
        assert owned, "checkpointed a claim whose lease is gone"
        event("checkpoint: recorded")
        self.update(record, recovery_point=point)

    @rule(target=marked, from_state=st.sampled_from([State.IN_PROGRESS, State.RELEASED]))
    def sweep(self, from_state: State) -> Any:
        now = self.now()
        keep_until = now + ms(POLICY.retention_seconds)
        # Each owner write dates a record and its deadline, the threshold it was claimed with.
        due = {
            slot
            for slot, s in self.model.items()
            if s.state is from_state
            and s.updated_at + ms(POLICY.stale_seconds) < now
            # released records only when they got past a recovery point
            and (from_state is State.IN_PROGRESS or s.recovery_point is not None)
        }

        marked = self.store.sweep(from_state, now / 1000, now / 1000, keep_until / 1000, 1000)

        assert {(r.principal, r.key) for r in marked} == due
        event(f"sweep: {len(marked)} marked")
        for slot in due:
            current = self.model[slot]
            self.model[slot] = dataclasses.replace(
                current,
                state=State.STALE,
                updated_at=now,
                expires_at=max(current.expires_at, keep_until),
            )
        for record in marked:
            self.assert_matches(record, self.model[record.principal, record.key])
        return multiple(*marked)

    @rule(
        record=consumes(marked),
        settle=st.booleans(),
        forget=st.booleans(),
        response=st.sampled_from(RESPONSES),
    )
    def resolve_stale(self, record: Record, settle: bool, forget: bool, response: Response) -> None:
        slot = self.model.get((record.principal, record.key))
        as_marked = (
            slot is not None
            and slot.state is State.STALE
            and slot.lease == record.lease_token
            and slot.updated_at == ms(record.updated_at)
        )
        if settle:
            done = self.store.settle_stale(
                record, State.COMPLETED, response, self.clock(), self.clock() + 3600
            )
        else:
            done = self.store.release_stale(record, self.clock(), forget_progress=forget)

        assert done is as_marked
        event(f"resolve_stale: {'done' if done else 'refused'}")
        if done and settle:
            self.update(
                record,
                state=State.COMPLETED,
                response=response,
                expires_at=self.now() + 3_600_000,
            )
        elif done:
            point = None if forget else record.recovery_point
            self.update(record, state=State.RELEASED, recovery_point=point)

    @rule(limit=st.integers(min_value=1, max_value=4))
    def purge(self, limit: int) -> None:
        now = self.now()
        due = [slot for slot, s in self.model.items() if past_retention(s, now)]

        deleted = self.store.purge(self.clock(), limit)

        assert deleted == min(limit, len(due))
        event(f"purge: {deleted} deleted")
        gone = [slot for slot in due if self.store.get(*slot) is None]
        assert len(gone) == deleted
        for slot in gone:
            del self.model[slot]

    @rule(seconds=st.sampled_from([1, 5, 12, 13, 20, 30, 60, 61]))
    def advance(self, seconds: int) -> None:
        """Time passes: to and past the stale threshold (12 s) and the retentions (20, 60 s)."""
        self.clock.advance(seconds)

    # --- a whole request through the driver --------------------------------------------

    @rule(
        principal=principals,
        key=keys,
        fingerprint=fingerprints,
        outcome=st.sampled_from([201, 200, 402, 503, 429, "raise"]),
    )
    def run(self, principal: str, key: str, fingerprint: str, outcome: int | str) -> None:
        slot = self.model.get((principal, key))
        owned = self.free_for(slot, fingerprint)
        boom = Boom("handler failed")
        calls: list[int] = []

        def handler(attempt: Any) -> Response:
            calls.append(1)
            if outcome == "raise":
                raise boom
            assert isinstance(outcome, int)
            return Response(outcome, f"answer {outcome}".encode())

        idem = Idempotency(self.store, POLICY, clock=self.clock)
        intent = Intent(principal, key, fingerprint, endpoint="POST /things")
        result: Any = None
        error: BaseException | None = None
        try:
            result = idem.run(intent, handler, transaction=self.transaction)
        except (Boom, KeyReused, InProgress) as exc:
            error = exc

        assert len(calls) == int(owned)
        if owned:
            self.check_executed((principal, key), fingerprint, boom, result, error)
        else:
            assert slot is not None
            self.check_dispatched(slot, fingerprint, result, error)

    def check_executed(
        self, where: tuple[str, str], fingerprint: str, boom: Boom, result: Any, error: Any
    ) -> None:
        """Ours to run: settled outcomes stored, transient ones and exceptions released."""
        if error is not None:
            assert error is boom, error  # the handler's own exception, unchanged
            event("run: handler raised, released")
            state, stored = State.RELEASED, None
        else:
            assert not result.replayed
            state = POLICY.classify(result.response).value or State.RELEASED
            stored = result.response if state in SETTLED else None
            event(f"run: executed, {state.value}")
        self.model[where] = self.after_run(self.model.get(where), fingerprint, state, stored)

    def check_dispatched(self, slot: Slot, fingerprint: str, result: Any, error: Any) -> None:
        """Someone else's: 422 for another request, the replay if settled, else 409."""
        if slot.fingerprint != fingerprint:
            assert isinstance(error, KeyReused), (error, result)
            event("run: key reused")
        elif slot.state in SETTLED and slot.response is not None:
            assert error is None, error
            assert result.replayed
            assert result.response == slot.response
            event("run: replayed")
        else:
            assert type(error) is InProgress, (error, result)
            # Dated by the slot's own age (the model's updated_at, not the store's).
            dated = Record(0, "", "", "", "", slot.state, None, 0, slot.updated_at / 1000, 0)
            assert error.retry_after == retry_after(dated, POLICY, self.clock())
            event(f"run: in progress ({slot.state.value})")

    def after_run(
        self, slot: Slot | None, fingerprint: str, state: State, response: Response | None
    ) -> Slot:
        claimed = self.claimed(slot, fingerprint, None, POLICY.retention_seconds)
        return dataclasses.replace(claimed, state=state, response=response)

    # --- the comparison ---------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        for principal in PRINCIPALS:
            for key in KEYS:
                record = self.store.get(principal, key)
                slot = self.model.get((principal, key))
                if slot is None:
                    assert record is None, f"store holds {record}, model holds nothing"
                else:
                    assert record is not None, f"store lost {slot}"
                    self.assert_matches(record, slot)

    @staticmethod
    def assert_matches(record: Record, slot: Slot) -> None:
        seen = Slot(
            state=record.state,
            fingerprint=record.fingerprint,
            lease=record.lease_token if slot.lease is not None else None,
            created_at=ms(record.created_at),
            updated_at=ms(record.updated_at),
            expires_at=ms(record.expires_at),
            response=record.response,
            recovery_point=record.recovery_point,
            attempt=record.attempt,
        )
        assert seen == slot, f"store {seen} != model {slot}"


MACHINE_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class MemoryMachine(IdempotencyMachine):
    def open_store(self, workdir: Path) -> tuple[Any, Any]:
        return MemoryStore(), None


class SQLiteMachine(IdempotencyMachine):
    def open_store(self, workdir: Path) -> tuple[Any, Any]:
        path = workdir / "keys.db"
        store = SQLiteStore(path)
        store.migrate()
        caller = sqlite3.connect(path, isolation_level=None, timeout=5)
        return store, SQLite3Transaction(caller)


TestMemoryStoreAgainstModel = MemoryMachine.TestCase
TestMemoryStoreAgainstModel.settings = MACHINE_SETTINGS
TestSQLiteStoreAgainstModel = SQLiteMachine.TestCase
TestSQLiteStoreAgainstModel.settings = MACHINE_SETTINGS
