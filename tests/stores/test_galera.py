"""
The MySQL store on a real three-node MariaDB Galera cluster: several primaries.

The shared contract and the race suites run here through the ``galera``
backend (its connections spread over every node). These tests add what
multi-primary replication adds: a conflict between two nodes is found at
*certification* (after the statement ran locally), and the loser gets error
1213 (deadlock) instead of a duplicate-key error or a lock wait. The cluster
runs with ``wsrep_retry_autocommit = 0``, so every such failure reaches the
store, which must turn each into the right answer: a claim retried and then
dispatched on the record (409, replay, 422), a completion or release retried
(fenced) or answered 503 when the caller's transaction was rolled back, a
sweep retried: never a 500, never a second execution.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemflow import (
    ConfigurationError,
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Record,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.sweeper import DidNotHappen, Sweeper
from idemflow.testing import FrozenClock
from tests.backends import galera_urls
from tests.stores._race import Recorder

pymysql = pytest.importorskip("pymysql")
from idemflow.stores.mysql import MySQLStore, connect_kwargs  # noqa: E402
from idemflow.transactions import PyMySQLTransaction  # noqa: E402
from tests.factories import POLICY  # noqa: E402

pytestmark = pytest.mark.mysql

CREATED = Response(201, b"created")
DEADLOCK, DUPLICATE = 1213, 1062


def connect(url: str, **extra: Any) -> Any:
    return pymysql.connect(**connect_kwargs(url), autocommit=True, **extra)


def cert_failures(urls: tuple[str, ...]) -> int:
    """Transactions that failed certification so far, summed over every node."""
    total = 0
    for url in urls:
        with contextlib.closing(connect(url)) as conn, conn.cursor() as cursor:
            cursor.execute("SHOW GLOBAL STATUS LIKE 'wsrep_local_cert_failures'")
            total += int(cursor.fetchone()[1])
    return total


@pytest.fixture
def urls() -> tuple[str, ...]:
    return galera_urls()


@pytest.fixture
def stores(urls: tuple[str, ...], table_name: str) -> Iterator[list[MySQLStore]]:
    """One store per node, on one table: the primaries an app's servers would use."""
    made = [MySQLStore(url, table=table_name, max_size=8, clock="caller") for url in urls]
    made[0].migrate()
    with contextlib.closing(connect(urls[0])) as conn, conn.cursor() as cursor:
        cursor.execute(f"CREATE TABLE biz_{table_name} (id BIGINT AUTO_INCREMENT PRIMARY KEY)")
    yield made
    for store in made:
        store.close()
    with contextlib.closing(connect(urls[0])) as conn, conn.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {table_name}, biz_{table_name}")


def at_once(tasks: list[Callable[[], str]]) -> collections.Counter[str]:
    """Run ``tasks`` in threads released together by a barrier; count what each returned."""
    barrier = threading.Barrier(len(tasks))
    results: list[str] = []
    lock = threading.Lock()

    def run(task: Callable[[], str]) -> None:
        barrier.wait(timeout=60)
        try:
            result = task()
        except BaseException as exc:  # counted: the test fails on it
            result = f"error: {type(exc).__name__}: {exc}"
        with lock:
            results.append(result)

    threads = [threading.Thread(target=run, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return collections.Counter(results)


def test_two_primaries_inserting_one_key_lose_by_certification(
    urls: tuple[str, ...], table_name: str
) -> None:
    """The failure the store must handle, shown raw: the loser of a cross-node race
    gets 1213 (certification failure), not 1062 (duplicate key)."""
    with contextlib.closing(connect(urls[0])) as conn, conn.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table_name} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
                       "k VARCHAR(32) NOT NULL, UNIQUE KEY (k))")  # fmt: skip
    conns = [connect(url) for url in urls for _ in range(2)]
    codes: collections.Counter[str] = collections.Counter()
    try:
        for n in range(30):

            def insert(conn: Any, key: str = f"k{n}") -> str:
                try:
                    with conn.cursor() as cursor:
                        cursor.execute(f"INSERT INTO {table_name} (k) VALUES (%s)", (key,))
                except pymysql.err.MySQLError as exc:
                    return str(exc.args[0])
                return "inserted"

            codes += at_once([functools.partial(insert, c) for c in conns])
    finally:
        for conn in conns:
            conn.close()
        with contextlib.closing(connect(urls[0])) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}")

    assert codes["inserted"] == 30, codes  # exactly one winner per key, always
    assert set(codes) <= {"inserted", str(DUPLICATE), str(DEADLOCK)}, codes
    assert codes[str(DEADLOCK)] > 0, codes


def test_claimants_on_every_primary_run_once_and_the_losers_are_dispatched(
    stores: list[MySQLStore], urls: tuple[str, ...]
) -> None:
    """Claims of one key from three nodes at once: one execution, every loser 409 or
    the replay, although many of them met a certification failure on the way."""
    before = cert_failures(urls)
    handler = Recorder()
    rounds = 25
    for n in range(rounds):
        intent = Intent("racer", f"k{n}", "fp")

        def claim(store: MySQLStore, intent: Intent = intent) -> str:
            try:
                outcome = Idempotency(store, POLICY).run(intent, handler)
            except InProgress:
                return "in_progress"
            return "replayed" if outcome.replayed else "executed"

        counts = at_once([functools.partial(claim, s) for s in stores for _ in range(4)])
        assert counts["executed"] == 1, counts
        assert counts["in_progress"] + counts["replayed"] == 11, counts
    assert len(handler.calls) == rounds
    assert cert_failures(urls) > before  # the losers really lost in certification


def test_a_key_reused_across_primaries_is_422_on_every_node(stores: list[MySQLStore]) -> None:
    """A different request under a racing key is dispatched as 422, on whichever node."""
    first = Recorder()
    Idempotency(stores[0], POLICY).run(Intent("alice", "k", "fp-1"), first)
    for store in stores:
        with pytest.raises(KeyReused) as raised:
            Idempotency(store, POLICY).run(Intent("alice", "k", "fp-2"), Recorder())
        assert raised.value.status == 422
    assert len(first.calls) == 1


class SweptBeforeCommit(PyMySQLTransaction):
    """The caller's transaction on one node; just before it commits, the sweeper on
    another node marks the claim stale (a request that outlived its threshold)."""

    def __init__(self, connection: Any, sweep: Callable[[], list[Record]]) -> None:
        super().__init__(connection)
        self._sweep = sweep
        self.marked: list[Record] = []

    def commit(self) -> None:
        if not self.marked:
            self.marked = self._sweep()
        super().commit()


def test_a_completion_that_loses_certification_to_the_sweeper_is_a_503(
    stores: list[MySQLStore], urls: tuple[str, ...], table_name: str
) -> None:
    """The owner commits effect + completion on node 1 while the sweeper marked the
    claim on node 2: certification rolls the owner back (1213). That is a 503 with
    nothing settled and no business row; the sweeper resolves it and the retry runs."""
    clock = FrozenClock()
    owner, sweeper_store = stores[0], stores[1]
    idem = Idempotency(owner, POLICY, clock=clock)

    def sweep() -> list[Record]:
        past = clock() + POLICY.stale_seconds + 1  # the claim's own deadline passed
        return sweeper_store.sweep(State.IN_PROGRESS, past, clock(), clock() + 3600, 10)

    def handler(attempt: Any) -> Response:
        with attempt.connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table_name} () VALUES ()")
        return CREATED

    with contextlib.closing(connect(urls[0])) as conn:
        transaction = SweptBeforeCommit(conn, sweep)
        with pytest.raises(StoreUnavailable) as raised:
            idem.run(Intent("alice", "k", "fp"), handler, transaction=transaction)
    assert raised.value.status == 503
    assert len(transaction.marked) == 1
    with contextlib.closing(connect(urls[2])) as conn, conn.cursor() as cursor:
        cursor.execute("SET SESSION wsrep_sync_wait = 1")
        cursor.execute(f"SELECT count(*) FROM biz_{table_name}")
        assert cursor.fetchone()[0] == 0  # the effect rolled back with the completion
    record = sweeper_store.get("alice", "k")
    assert record is not None
    assert record.state is State.STALE  # the sweeper's now: not released by the loser

    clock.advance(POLICY.stale_seconds + 1)
    report = Sweeper(sweeper_store, POLICY, reconciler=lambda r, k: DidNotHappen(), clock=clock)
    assert report.sweep_once().released == 1
    retry = Recorder()
    assert Idempotency(stores[2], POLICY, clock=clock).run(Intent("alice", "k", "fp"), retry)
    assert len(retry.calls) == 1


def test_single_commit_is_refused_on_galera(
    stores: list[MySQLStore], urls: tuple[str, ...]
) -> None:
    """A claim inside the caller's transaction is certified only at COMMIT: two nodes
    could both run the handler. Refused before anything is claimed."""
    handler = Recorder()
    with contextlib.closing(connect(urls[0])) as conn:
        with pytest.raises(ConfigurationError, match="Galera"):
            Idempotency(stores[0], POLICY).run(
                Intent("alice", "k", "fp"),
                handler,
                transaction=PyMySQLTransaction(conn),
                single_commit=True,
            )
        conn.rollback()
    assert handler.calls == []
    assert stores[0].get("alice", "k") is None


def test_owners_and_a_sweeper_on_other_nodes_never_both_win(
    stores: list[MySQLStore], urls: tuple[str, ...]
) -> None:
    """Owners complete or release their claims on node 1 (no shared transaction) while
    sweepers on nodes 2 and 3 mark the same claims: each record goes to exactly one
    side, the loser learns it (LeaseLost / False / not marked), nothing raises else."""
    clock = FrozenClock()
    owner, sweepers = stores[0], stores[1:]
    before = cert_failures(urls)
    rounds, per_round = 8, 12
    lock = threading.Lock()
    for n in range(rounds):
        claims = [
            owner.claim(Intent("alice", f"r{n}-{i}", "fp"), f"tok-{n}-{i}", clock(), clock() + 60)
            for i in range(per_round)
        ]
        assert all(claim.owned for claim in claims)
        owned = [claim.record for claim in claims]
        won: dict[str, list[str]] = collections.defaultdict(list)

        def settle(owned: list[Record] = owned, won: Any = won) -> str:
            for i, record in enumerate(owned):
                try:
                    if i % 2:
                        ok = owner.release(record, clock())
                    else:
                        owner.complete(record, State.COMPLETED, CREATED, clock(), clock() + 60)
                        ok = True
                except LeaseLost:
                    ok = False
                if ok:
                    with lock:
                        won[record.key].append("owner")
            return "owner done"

        def sweep(store: MySQLStore, won: Any = won) -> str:
            for _ in range(per_round):
                past = clock() + 3600  # every claim's own deadline passed
                for record in store.sweep(State.IN_PROGRESS, past, clock(), clock() + 60, 2):
                    with lock:
                        won[record.key].append("sweeper")
            return "sweeper done"

        counts = at_once([settle, *[functools.partial(sweep, s) for s in sweepers]])
        assert counts == {"owner done": 1, "sweeper done": 2}, counts
        assert sorted(won) == sorted(record.key for record in owned)
        assert all(len(sides) == 1 for sides in won.values()), won
    assert cert_failures(urls) > before


def test_a_node_cut_off_from_the_quorum_answers_503(
    stores: list[MySQLStore], urls: tuple[str, ...]
) -> None:
    """A node partitioned from the others leaves the primary component and refuses
    queries (1047): a 503, the handler never runs. Rejoined, it claims again."""
    from tests._galera import set_isolated

    handler = Recorder()
    set_isolated(2, True)
    try:
        with pytest.raises(StoreUnavailable) as raised:
            Idempotency(stores[2], POLICY).run(Intent("alice", "k", "fp"), handler)
    finally:
        set_isolated(2, False)
    assert raised.value.status == 503
    assert handler.calls == []
    assert not Idempotency(stores[2], POLICY).run(Intent("alice", "k", "fp"), handler).replayed
    assert len(handler.calls) == 1
