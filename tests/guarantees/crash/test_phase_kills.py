"""
Single-commit mode killed (SIGKILL) around a committed phase and around ``CommitClaim``.

A request process dies at one of these moments, its open transaction rolled back by the
database and nothing else run (no ``finally``, no release):

- ``after_commit_phase``: the first ``commit_phase`` committed (the claim with it);
- ``after_call``: the provider charged, past that phase;
- ``before_commit_claim``: a retry resuming past the phase took the key over, not yet
  committed;
- ``after_commit_claim``: that take-over committed (``_flow.CommitClaim``), the handler
  not yet started;
- ``after_resumed_call``: the resumed handler charged.

The provider honours no downstream key: only the key's state stands between a retry and
a second charge. After the kill a client retries as it would, the sweeper (with a
reconciler reading the provider's ledger) passing whenever the key is held: each intent
converges to one 201 and exactly one charge. Before ``CommitClaim``, ``after_resumed_call``
charged twice: the kill rolled the take-over back, the record read "released" again, and
the next retry resumed and charged a second time.

One spawned launcher imports everything once and forks a doomed child per moment (it
holds no connection or thread when it forks); the children use the sync driver, the
parent sweeps and retries on its own connections, on an injected clock.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemflow import Idempotency, InProgress, Response, State
from idemflow._sync.edge import pooled_transaction
from idemflow.sweeper import DidNotHappen, Happened, Sweeper
from idemflow.testing import FrozenClock
from tests.guarantees.crash._phase_child import (
    CREATED,
    FRESH,
    PHASE,
    POLICY,
    RESUMED,
    START,
    Side,
    handler_for,
    intent,
)
from tests.guarantees.crash._phase_child import launch as _launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@contextlib.contextmanager
def tables(kind: str) -> Iterator[Side]:
    if kind == "postgres":
        from tests.factories import psycopg_or_skip

        psycopg_or_skip()
    else:
        pymysql = pytest.importorskip("pymysql")
        from idemflow.stores.mysql import connect_kwargs
        from tests.backends import MYSQL_URL
        from tests.conftest import unreachable

        try:
            pymysql.connect(**connect_kwargs(MYSQL_URL), connect_timeout=3).close()
        except pymysql.err.OperationalError as exc:
            unreachable("MariaDB", exc)
    side = Side(kind, f"idem_{uuid.uuid4().hex[:12]}")
    store = side.store(migrating=True)
    store.migrate()
    store.close()
    with side.connect() as conn:
        side.execute(conn, f"CREATE TABLE biz_{side.table} (note VARCHAR(20))")
        side.execute(conn, f"CREATE TABLE provider_{side.table} (k VARCHAR(100), dk VARCHAR(100))")
    try:
        yield side
    finally:
        with side.connect() as conn:
            for name in (side.table, f"biz_{side.table}", f"provider_{side.table}"):
                side.execute(conn, f"DROP TABLE IF EXISTS {name}")


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_a_single_commit_request_killed_around_a_phase_converges_with_one_charge(
    kind: str,
) -> None:
    """Each moment of death leaves the key claimed for the sweeper, or (the take-over not
    yet committed) released as the earlier attempt left it; never released with the
    charge made. After the sweeps and the retries: one 201 and one charge per intent."""
    with tables(kind) as side:
        store = side.store()
        clock = FrozenClock(START)
        idem = Idempotency(store, POLICY, clock=clock)

        def run(key: str, handler: Callable[[Any], Response]) -> Any:
            with pooled_transaction(store.pool.connection, side.adapter()) as transaction:
                return idem.run(intent(key), handler, transaction=transaction, single_commit=True)

        def provider_down(attempt: Any) -> Response:
            side.execute(attempt.connection, f"INSERT INTO biz_{side.table} VALUES ('payment')")
            attempt.commit_phase(PHASE)
            return Response(503, b"provider down")

        try:
            for key in RESUMED:  # released at the phase: the doomed run resumes past it
                assert run(key, provider_down).response.status == 503
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            launcher = context.Process(
                target=_launch, args=(side, {k: k for k in FRESH + RESUMED}, results)
            )
            launcher.start()
            ends = results.get(timeout=90)
            launcher.join(10)
            left = {key: store.get("alice", key) for key in FRESH + RESUMED}

            def answer(record: Any, keys: Any) -> Any:
                if side.charges(downstream_key=keys["charge"]):
                    return Happened(CREATED)
                return DidNotHappen("the provider holds no charge under the key")

            sweeper = Sweeper(store, POLICY, reconciler=answer, steps=["charge"], clock=clock)
            finals = {key: _settle(run, handler_for(side), sweeper, clock, key) for key in left}
            charges = {key: side.charges(key) for key in left}
        finally:
            store.close()

    assert ends == dict.fromkeys(FRESH + RESUMED, signal.SIGKILL)
    assert {key: outcome.response.status for key, outcome in finals.items()} == dict.fromkeys(
        left, 201
    )
    assert charges == dict.fromkeys(left, 1)
    assert {key: (r.state, r.recovery_point) for key, r in left.items()} == {
        "after_commit_phase": (State.IN_PROGRESS, PHASE),
        "after_call": (State.IN_PROGRESS, PHASE),
        "before_commit_claim": (State.RELEASED, PHASE),  # the take-over rolled back
        "after_commit_claim": (State.IN_PROGRESS, PHASE),
        "after_resumed_call": (State.IN_PROGRESS, PHASE),
    }


def _settle(
    run: Callable[[str, Any], Any], handler: Any, sweeper: Sweeper, clock: FrozenClock, key: str
) -> Any:
    """Retry until a 201; whenever the key is held, the sweeper passes (past the threshold).
    A killed session's row lock lasts until its server notices the death: retried."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            outcome = run(key, handler)
        except InProgress:
            clock.advance(POLICY.stale_seconds + 1)
            sweeper.sweep_once()
            continue
        if outcome.response.status == 201:
            return outcome
    raise AssertionError(f"{key} never settled")
