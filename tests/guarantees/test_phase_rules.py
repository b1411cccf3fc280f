"""
The two phase rules of ``_flow`` on every store that has the mode, under pressure and faults.

``PhaseCommitted``: a completion that fails past a committed phase (this run's
``commit_phase``, or the recovery point an earlier attempt committed) keeps the claim
("could not be recorded", 409 to retries) instead of releasing it: the external call made
after the phase may have happened, and only the sweeper's reconciler may decide.
``CommitClaim``: a single-commit retry that resumes past a committed phase commits its
take-over before the handler runs, so a crash in the handler leaves the intent claimed,
never released for a second resume.

Every rig shares one pool of **one** connection between the store and the application
(tests/backends.py ``open_rig``; SQLite has no pool, Redis one connection): a request that
held two at once would deadlock here. The provider never honours a downstream key, so
only the rules stand between a retry and a second charge; the reconciler answers from the
provider's ledger. Faults are real: a server session terminated or KILLed, a deferred
foreign key failing the COMMIT, the file's write lock held, the Redis connection killed
(the memory store has no I/O: a double fails its completion). Cancellation is tried at
every await of a run (tests/guarantees/crash/test_phase_kills.py has the SIGKILLs).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncIdempotency,
    ConfigurationError,
    Idempotency,
    InProgress,
    Outcome,
    OutcomeUnknown,
    Policy,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.sweeper import AsyncSweeper, DidNotHappen, Happened, Sweeper
from idemflow.testing import FrozenClock
from tests.backends import Rig, open_rig, rig_params, rigs
from tests.factories import CREATED, AsyncForwardingTransaction
from tests.factories import uncorrelated_intent as intent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

POLICY = Policy(request_timeout=5)
UNAVAILABLE = Response(503, b"provider down")
PHASE = "charging"


@dataclass(frozen=True)
class Script:
    """What the handler does, step by step: ``fresh`` without a recovery point, ``resumed``
    past one. Steps: ``write:<note>`` (a business row on the attempt's connection),
    ``phase`` (``commit_phase``), ``call`` (the provider charges: no downstream key is
    honoured), ``lose`` (the rig's real fault), ``peek`` (the record as another session
    sees it), ``503`` (answer a transient failure), ``unknown`` (raise ``OutcomeUnknown``).
    It then answers 201."""

    fresh: tuple[str, ...]
    resumed: tuple[str, ...] = ("call", "write:charged")


#: Phase 1 commits a pending payment, then the provider is unavailable: released at the phase.
PROVIDER_DOWN = Script(("write:payment", "phase", "503"))
#: The whole payment: a pending row, the phase, the charge (and its answer awaited), the
#: row marked charged.
CHARGE = Script(
    ("write:payment", "phase", "call", "await", "write:charged"),
    ("call", "await", "write:charged"),
)
#: The payment, whose completion is lost after the charge (past the committed phase).
CHARGE_THEN_LOST = Script(
    ("write:payment", "phase", "call", "await", "write:charged", "lose"),
    ("call", "await", "write:charged", "lose"),
)


@dataclass
class World:
    """One test's rig, clock, the provider's ledger and what handlers saw."""

    rig: Rig
    clock: FrozenClock
    #: The provider's ledger: (key, downstream key) of every charge (none de-duplicated).
    charges: list[tuple[str, str]] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)
    #: The keys whose (async) handler started, once per run.
    started: list[str] = field(default_factory=list)
    points: Points | None = None

    def charged(self, key: str) -> int:
        return sum(1 for charged, _ in self.charges if charged == key)

    def knows(self, downstream_key: str) -> bool:
        return any(known == downstream_key for _, known in self.charges)


class Points:
    """Counts the awaits of one async run (store calls, transaction calls, the handler's own
    awaits) and cancels the run's task at the ``at``-th: ``before`` it is sent, ``during`` it
    (sent, not answered), or ``after`` it answered."""

    def __init__(self, at: int | None = None, when: str = "before") -> None:
        self.at, self.when = at, when
        self.count = 0
        self.names: list[str] = []
        self.task: asyncio.Task[Any] | None = None

    async def point(self, name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        self.count += 1
        self.names.append(name)
        if self.count != self.at:
            return await call()
        assert self.task is not None
        if self.when == "before":
            self.task.cancel()
            await asyncio.sleep(0)  # raises here unless the step is shielded
            return await call()
        if self.when == "during":
            pending = asyncio.ensure_future(call())
            await asyncio.sleep(0)
            self.task.cancel()
            return await pending
        result = await call()
        self.task.cancel()
        return result


class PointStore:
    """An async store whose every awaited call is a :class:`Points` point."""

    def __init__(self, inner: Any, points: Points) -> None:
        self.inner, self._points = inner, points

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(value):
            return value

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._points.point(f"store.{name}", lambda: value(*args, **kwargs))

        return call


class PointTransaction(AsyncForwardingTransaction):
    """The request's transaction, each awaited call a :class:`Points` point."""

    def __init__(self, inner: Any, points: Points) -> None:
        self.inner, self._points = inner, points

    @property
    def connection(self) -> Any:
        return self.inner.connection

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)

        async def call(*args: Any) -> Any:
            return await self._points.point(f"tx.{name}", lambda: value(*args))

        return call


def _act(world: World, attempt: Any, step: str) -> Any:
    """One step of a script: its result is awaited on async rigs."""
    kind, _, note = step.partition(":")
    if kind == "write":
        return world.rig.write(attempt.connection, note)
    if kind == "phase":
        return attempt.commit_phase(PHASE)
    if kind == "call":
        world.charges.append((attempt.record.key, attempt.downstream_key("charge")))
        return None
    if kind == "lose":
        return world.rig.lose(attempt.connection)
    if kind == "peek":
        world.seen.append(world.rig.peek(attempt.record.key))
        return None
    if kind == "await":  # the provider's answer, awaited (nothing to wait for when sync)
        return None if world.rig.sync else asyncio.sleep(0)
    if kind == "unknown":  # the provider's answer never came: guarantees/test_outcome_unknown.py
        raise OutcomeUnknown("the provider timed out after the charge was sent")
    raise AssertionError(step)


def handler_for(world: World, script: Script) -> Any:
    def steps(attempt: Any) -> tuple[str, ...]:
        return script.fresh if attempt.recovery_point is None else script.resumed

    if world.rig.sync:

        def handler(attempt: Any) -> Response:
            for step in steps(attempt):
                if step == "503":
                    return UNAVAILABLE
                _act(world, attempt, step)
            return CREATED

        return handler

    async def ahandler(attempt: Any) -> Response:
        world.started.append(attempt.record.key)
        for step in steps(attempt):
            if step == "503":
                return UNAVAILABLE

            async def act(step: str = step) -> None:
                result = _act(world, attempt, step)
                if inspect.isawaitable(result):
                    await result

            if world.points is None or step == "phase":  # its awaits are points of their own
                await act()
            else:
                await world.points.point(step, act)
        return CREATED

    return ahandler


async def run(
    world: World, script: Script, key: str = "k-1", *, single_commit: bool = False
) -> Outcome:
    """One request, as the rig's mode makes it, on the rig's shared pool."""
    rig = world.rig
    handler = handler_for(world, script)
    if rig.sync:

        def sync_run() -> Outcome:
            idem = Idempotency(rig.store, POLICY, clock=world.clock)
            if rig.transaction is None:
                return idem.run(intent(key), handler, single_commit=single_commit)
            with rig.transaction() as transaction:
                return idem.run(
                    intent(key), handler, transaction=transaction, single_commit=single_commit
                )

        try:
            return await asyncio.to_thread(sync_run)
        finally:
            rig.heal()
    points = world.points
    store = rig.store if points is None else PointStore(rig.store, points)
    idem = AsyncIdempotency(store, POLICY, clock=world.clock)
    try:
        if rig.transaction is None:
            return await idem.run(intent(key), handler, single_commit=single_commit)
        async with rig.transaction() as pooled:
            transaction = pooled if points is None else PointTransaction(pooled, points)
            return await idem.run(
                intent(key), handler, transaction=transaction, single_commit=single_commit
            )
    finally:
        rig.heal()


async def sweep(world: World) -> Any:
    """The sweeper, once the stale threshold has passed; the reconciler reads the ledger."""
    world.clock.advance(POLICY.stale_seconds + 1)
    rig = world.rig

    def answer(record: Any, keys: Any) -> Any:
        if world.knows(keys["charge"]):
            return Happened(CREATED)
        return DidNotHappen("the provider holds no charge under the key")

    if rig.sync:
        sweeper = Sweeper(rig.store, POLICY, reconciler=answer, steps=["charge"], clock=world.clock)
        return await asyncio.to_thread(sweeper.sweep_once)

    async def reconciler(record: Any, keys: Any) -> Any:
        return answer(record, keys)

    swept = AsyncSweeper(
        rig.store, POLICY, reconciler=reconciler, steps=["charge"], clock=world.clock
    )
    return await swept.sweep_once()


async def settle(
    world: World, script: Script, key: str = "k-1", *, single_commit: bool = False
) -> Outcome:
    """Retry with ``script`` as a client does, the sweeper passing whenever the key is held,
    until a 201."""
    for _ in range(4):
        try:
            outcome = await run(world, script, key, single_commit=single_commit)
        except InProgress:
            await sweep(world)
            continue
        if outcome.response.status == 201:
            return outcome
    raise AssertionError(f"{key} never settled")


def transactional_modes(
    drivers: tuple[str, ...] = ("async", "sync"), **capabilities: bool
) -> Iterator[Any]:
    """(rig, single_commit): every rig in a transaction (of the kinds with
    ``capabilities``), with two commits and, where its store can hold the claim too, one."""
    for kind, rig in rigs("transaction", drivers, **capabilities):
        yield pytest.param(rig, False, marks=kind.marks, id=f"{rig}-two-commit")
        if kind.single_commit:
            yield pytest.param(rig, True, marks=kind.marks, id=f"{rig}-single-commit")


async def record_of(rig: Rig, key: str = "k-1") -> Any:
    return await rig.call("get", "alice", key)


# --- both rules, in the transactional modes ---------------------------------------------


@pytest.mark.parametrize(("kind", "single_commit"), list(transactional_modes()))
async def test_a_lost_completion_keeps_the_claim_past_a_committed_phase_and_only_there(
    kind: str, single_commit: bool, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """The completion is lost (the request's connection ends, or its COMMIT fails) after
    the provider charged, past this run's ``commit_phase`` ("own") or past the phase an
    earlier attempt committed ("resumed"). The caller hears it could not be recorded, the
    key stays claimed at its recovery point, a retry gets 409 rather than charging again,
    and the sweeper's reconciler settles the charge: one charge, ever. The control: with
    no phase committed the effect rolled back whole, and the key is free at once.

    While the resumed handler runs, other sessions see its take-over committed (in
    single-commit mode too, where a fresh claim stays invisible until its first commit):
    had it stayed open, a crash would roll it back and a second resume would charge."""
    resumed = Script(("write:payment", "phase", "503"), ("peek", *CHARGE_THEN_LOST.resumed))
    async with open_rig(kind, table_name, tmp_path, transactional=True) as rig:
        world = World(rig, clock)
        losses: dict[str, BaseException] = {}
        for key, script in [("own", CHARGE_THEN_LOST), ("resumed", resumed)]:
            if key == "resumed":
                first = await run(world, script, key, single_commit=single_commit)
                assert first.response == UNAVAILABLE
            with pytest.raises(rig.lost) as lost:
                await run(world, script, key, single_commit=single_commit)
            losses[key] = lost.value
        held = [await record_of(rig, key) for key in losses]
        with pytest.raises(InProgress):
            await run(world, CHARGE, "own", single_commit=single_commit)
        with pytest.raises(InProgress):
            await run(world, CHARGE, "resumed", single_commit=single_commit)
        rows = rig.notes()
        report = await sweep(world)
        replays = [await run(world, CHARGE, key, single_commit=single_commit) for key in losses]

        with pytest.raises(rig.lost):
            await run(world, Script(("peek", "write:payment", "lose")), single_commit=single_commit)
        control = await record_of(rig)
        retry = await run(world, Script(("write:retried",)), single_commit=single_commit)
        control_rows = rig.notes()[len(rows) :]

    if rig.lost is StoreUnavailable:
        assert all("could not be recorded" in str(lost) for lost in losses.values())
    assert [(r.state, r.recovery_point) for r in held] == [(State.IN_PROGRESS, PHASE)] * 2
    assert rows == ["payment", "payment"]  # each committed phase stays; what followed rolled back
    assert report.completed == 2
    assert [(r.replayed, r.response.status) for r in replays] == [(True, 201)] * 2
    assert [world.charged(key) for key in losses] == [1, 1]
    assert world.seen == [State.IN_PROGRESS, None if single_commit else State.IN_PROGRESS]
    assert (None if control is None else control.state) is (
        None if single_commit else State.RELEASED
    )
    assert (retry.replayed, retry.response.status) == (False, 201)
    assert control_rows == ["retried"]


@pytest.mark.parametrize("kind", rig_params("no-transaction", cluster=False))
async def test_no_transaction_lost_completion_past_a_checkpoint_keeps_the_claim(
    kind: str, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """Without a transaction ``commit_phase`` is a checkpoint and every effect is external:
    a lost completion keeps the claim on every store, 409 to the retry, one charge."""
    async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
        world = World(rig, clock)
        with pytest.raises(StoreUnavailable, match="could not be recorded"):
            await run(world, Script(("phase", "call", "lose"), ("call",)))
        held = await record_of(rig)
        with pytest.raises(InProgress):
            await run(world, CHARGE)
        report = await sweep(world)
        replay = await run(world, CHARGE)

    assert held is not None
    assert (held.state, held.recovery_point) == (State.IN_PROGRESS, PHASE)
    assert report.completed == 1
    assert (replay.replayed, replay.response.status) == (True, 201)
    assert world.charged("k-1") == 1


# --- where single-commit mode is refused -------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "transactional", "refusal"),
    [
        ("sqlite", True, "single_commit needs PostgreSQL or MySQL"),
        ("sqlite-sync", True, "single_commit needs PostgreSQL or MySQL"),
        ("sqlite", False, "single_commit needs the caller's transaction"),
        pytest.param("redis", False, "needs the caller's transaction", marks=pytest.mark.redis),
        ("memory", False, "single_commit needs the caller's transaction"),
    ],
)
async def test_single_commit_is_refused_where_the_store_cannot_hold_it(
    kind: str,
    transactional: bool,
    refusal: str,
    tmp_path: Path,
    table_name: str,
    clock: FrozenClock,
) -> None:
    """SQLite admits one writer (a duplicate would queue behind the whole transaction);
    Redis and memory share no transaction. Each refuses single-commit mode with a
    ConfigurationError that says why, before anything is claimed or run."""
    async with open_rig(kind, table_name, tmp_path, transactional=transactional) as rig:
        world = World(rig, clock)
        with pytest.raises(ConfigurationError, match=refusal):
            await run(world, Script(("call",)), single_commit=True)
        left = await record_of(rig)

    assert left is None
    assert world.charges == []


# --- cancellation at every await ------------------------------------------------------


def cancellation_cases() -> Iterator[Any]:
    """Async rigs (the sync driver cannot be cancelled) in each mode they have."""
    for case in transactional_modes(("async",)):
        rig, single_commit = case.values
        mode = "single-commit" if single_commit else "two-commit"
        yield pytest.param(rig, mode, marks=case.marks, id=case.id)
    for kind, rig in rigs("no-transaction", ("async",), cluster=False):
        yield pytest.param(rig, "no-transaction", marks=kind.marks, id=f"{rig}-no-transaction")


@dataclass(frozen=True)
class Scenario:
    name: str
    #: Run first, without faults (None: the key is fresh).
    prepare: Script | None
    run: Script
    #: The modes it applies to (None: every mode).
    modes: tuple[str, ...] | None = None


WHENS = ("during", "after")
SCENARIOS = [
    # PhaseCommitted: past this run's own phase, the completion lost after the charge.
    Scenario("lost-past-own-phase", None, CHARGE_THEN_LOST),
    # CommitClaim (single commit): a resume after the provider was down, charging first.
    Scenario("resumed", PROVIDER_DOWN, CHARGE),
    # Without a transaction nothing rolls back: a charge made before any checkpoint is
    # past a committed "phase" too (in a transaction the contract is commit_phase first).
    Scenario("call-without-a-phase", None, Script(("call", "await")), ("no-transaction",)),
]


def cancellation_params() -> Iterator[Any]:
    for case in cancellation_cases():
        kind, mode = case.values
        for scenario in SCENARIOS:
            if scenario.modes is None or mode in scenario.modes:
                yield pytest.param(
                    kind, mode, scenario, marks=case.marks, id=f"{scenario.name}-{case.id}"
                )


def without_rows(script: Script) -> Script:
    return Script(
        *(tuple(s for s in steps if ":" not in s) for steps in (script.fresh, script.resumed))
    )


@pytest.mark.parametrize(("kind", "mode", "scenario"), list(cancellation_params()))
async def test_cancelled_at_any_await_never_charges_twice(
    kind: str, mode: str, scenario: Scenario, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """The request's task is cancelled at each await of its run in turn (every store and
    transaction call, the handler's own awaits, the commit of the take-over, the answer
    to a lost completion), before, during or after it. Whatever the moment: the key is
    free or claimed for the sweeper, never holds a stored transient failure, and once the
    sweeper and the retries are done the provider has charged exactly once."""
    single_commit = mode == "single-commit"
    transactional = mode != "no-transaction"
    async with open_rig(kind, table_name, tmp_path, transactional=transactional) as rig:
        world = World(rig, clock)
        prepare, script, retry = scenario.prepare, scenario.run, CHARGE
        if not transactional:  # no business table: the same steps, without the rows
            script, retry = without_rows(script), without_rows(retry)
            prepare = None if prepare is None else without_rows(prepare)

        async def attempt(key: str, points: Points) -> tuple[BaseException | Outcome, bool]:
            """The run cancelled at ``points``: how it ended, and whether its handler ran."""
            if prepare is not None:
                await run(world, prepare, key, single_commit=single_commit)
            started = len(world.started)
            world.points = points
            task = asyncio.ensure_future(run(world, script, key, single_commit=single_commit))
            points.task = task
            try:
                ended: BaseException | Outcome = await task
            except (asyncio.CancelledError, Exception) as exc:
                ended = exc
            finally:
                world.points = None
            return ended, len(world.started) > started

        counted = Points()
        await attempt("count", counted)
        assert counted.count >= 3, counted.names
        failures: list[str] = []
        for at in range(1, counted.count + 1):
            # "before" matters where the call is the transaction's own (a rollback never
            # sent); elsewhere it is the "after" of the await before.
            name = counted.names[at - 1]
            for when in ("before", "during", "after") if name.startswith("tx.") else WHENS:
                key = f"k-{at}-{when}"
                ended, ran = await attempt(key, Points(at, when))
                where = f"{name} ({when}, point {at}): {ended!r}"
                try:
                    left = await record_of(rig, key)
                except StoreUnavailable as exc:  # the pool handed out a connection it lost
                    failures.append(f"{where}: then {exc!r}")
                    left = await record_of(rig, key)
                if left is not None and left.state not in (
                    State.IN_PROGRESS,
                    State.RELEASED,
                    State.COMPLETED,
                ):
                    failures.append(f"{where}: left {left.state}")
                if not ran and left is not None and left.state is not State.RELEASED:
                    failures.append(f"{where}: the handler never ran, yet {left.state}")
                if left is not None and left.response is not None and left.response.status != 201:
                    failures.append(f"{where}: stored {left.response.status}")
                if world.charged(key) > 1:
                    failures.append(f"{where}: charged {world.charged(key)} times at once")
                final = await settle(world, retry, key, single_commit=single_commit)
                if final.response.status != 201 or world.charged(key) != 1:
                    failures.append(f"{where}: charged {world.charged(key)} times in all")

    assert failures == [], "\n".join(failures)


# --- middleware: the endpoint's effect is its own, so a lost completion keeps the claim ----


@pytest.mark.parametrize("kind", rig_params("no-transaction", ("async",)))
async def test_middleware_lost_completion_keeps_the_claim_on_every_store(
    kind: str, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """``IdempotencyMiddleware`` cannot share the endpoint's transaction: the endpoint
    charged, then the store lost the completion. Every store answers a 503 that says the
    outcome went unrecorded, keeps the claim (409 to the retry, not a second charge), and
    the sweeper's reconciler settles it into the replayed 201."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.responses import Response as StarletteResponse

    from tests.guarantees.test_modes import call_asgi, middleware_app, status_of

    async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
        world = World(rig, clock)

        async def create(request: Request) -> StarletteResponse:
            key = request.headers["idempotency-key"]
            world.charges.append((key, key))  # the endpoint's own effect
            await rig.lose(None)
            return JSONResponse({"id": "pay_1"}, status_code=201)

        app = middleware_app(AsyncIdempotency(rig.store, POLICY, clock=clock), create)
        first = await call_asgi(app, "k-mw")
        rig.heal()
        retry = await call_asgi(app, "k-mw")
        held = await rig.call("get", "carol", "k-mw")

        def answer(record: Any, keys: Any) -> Any:
            return Happened(CREATED) if world.charged(record.key) else DidNotHappen()

        async def reconciler(record: Any, keys: Any) -> Any:
            return answer(record, keys)

        clock.advance(POLICY.stale_seconds + 1)
        report = await AsyncSweeper(
            rig.store, POLICY, reconciler=reconciler, clock=clock
        ).sweep_once()
        replay = await call_asgi(app, "k-mw")

    body = b"".join(m.get("body", b"") for m in first if m["type"] == "http.response.body")
    assert status_of(first) == 503
    assert b"could not be recorded" in body
    assert status_of(retry) == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert report.completed == 1
    assert status_of(replay) == 201
    assert world.charged("k-mw") == 1
