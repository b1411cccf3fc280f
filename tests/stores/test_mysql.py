"""
The MySQL/MariaDB store beyond the shared contract (which runs both with and
without ``CLIENT_FOUND_ROWS`` through the ``mysql`` and ``mysql-found-rows``
backends).

What only MySQL has to show: the affected-row counts the claim relies on,
binary key columns, the caller's transaction under READ COMMITTED and
REPEATABLE READ (whose stale snapshot must not reach dispatch), the CLI
migration, an unreachable server, and races with the caller's transaction.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    Attempt,
    Idempotency,
    InProgress,
    LeaseLost,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.testing import FrozenClock
from tests.backends import MYSQL_URL
from tests.conftest import unreachable
from tests.factories import CREATED, POLICY
from tests.factories import uncorrelated_intent as intent
from tests.stores._race import Recorder, assert_exactly_once, race_processes, race_threads

pymysql = pytest.importorskip("pymysql")
from idemflow.stores.mysql import (  # noqa: E402
    MySQLStore,
    connect_kwargs,
    mysql_dialect,
    mysql_statements,
)
from idemflow.transactions import PyMySQLTransaction  # noqa: E402

pytestmark = pytest.mark.mysql

T0 = 1_700_000_000.0
FOUND_ROWS = 2
ISOLATION_LEVELS = ["READ COMMITTED", "REPEATABLE READ"]


def connect(**extra: Any) -> Any:
    return pymysql.connect(**connect_kwargs(MYSQL_URL), **extra)


@pytest.fixture
def store(table_name: str) -> Iterator[MySQLStore]:
    try:
        probe = connect(connect_timeout=3)
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    with contextlib.closing(probe), probe.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE biz_{table_name} (id BIGINT AUTO_INCREMENT PRIMARY KEY, k TEXT)"
        )
    made = MySQLStore(MYSQL_URL, table=table_name, max_size=8, clock="caller")
    made.migrate()
    yield made
    made.close()
    with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {table_name}, biz_{table_name}")


def business_rows(table: str) -> int:
    with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM biz_{table}")
        return int(cursor.fetchone()[0])


def write_business(table: str) -> Any:
    def write(conn: Any, note: str) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table} (k) VALUES (%s)", (note,))

    return write


# --- the claim's affected-row counts ---------------------------------------------------


@pytest.mark.parametrize(("flag", "expected"), [(0, [1, 0, 2]), (FOUND_ROWS, [1, 1, 2])])
def test_claim_counts_are_what_the_store_reads(
    store: MySQLStore, flag: int, expected: list[int]
) -> None:
    """The upsert counts insert 1, someone else's 0 (1 with CLIENT_FOUND_ROWS), takeover 2."""
    from idemflow.stores.sql.dialect import claim_params, complete_params

    claim = store.dialect.claim
    counts = []
    with contextlib.closing(connect(autocommit=True, client_flag=flag)) as conn:

        def run(token: str, now: float) -> None:
            params = claim_params(intent(), token, now, now + 3600)
            with conn.cursor() as cursor:
                counts.append(cursor.execute(claim.pyformat, claim.bind(params)))

        run("lease-a", 1_000.0)  # absent: inserted
        run("lease-b", 1_000.0)  # held by lease-a: untouched
        record = store.get("alice", "k-1")
        assert record is not None
        done = complete_params(record, State.COMPLETED, Response(201), 1_000.0, 4_600.0)
        with conn.cursor() as cursor:
            cursor.execute(store.dialect.complete.pyformat, store.dialect.complete.bind(done))
        run("lease-c", 4_601.0)  # settled, and past its retention (1 h): taken over
    assert counts == expected


def test_found_rows_store_decides_by_lease_token(table_name: str, store: MySQLStore) -> None:
    """With CLIENT_FOUND_ROWS the claim, the takeover and its loser are all read correctly."""
    found = MySQLStore(
        {**connect_kwargs(MYSQL_URL), "client_flag": FOUND_ROWS}, table=table_name, clock="caller"
    )
    clock = FrozenClock()
    first = found.claim(intent(), "lease-a", clock(), clock() + 60)
    second = found.claim(intent(), "lease-b", clock(), clock() + 60)
    assert found.release(first.record, clock())
    retry = found.claim(intent(), "lease-c", clock(), clock() + 60)
    late = found.claim(intent(), "lease-d", clock(), clock() + 60)
    found.complete(retry.record, State.COMPLETED, Response(201), clock(), clock() + 60)
    clock.advance(61)
    expired = found.claim(intent(fp="fp-2"), "lease-e", clock(), clock() + 60)
    found.close()

    assert [c.owned for c in (first, second, retry, late, expired)] == [1, 0, 1, 0, 1]
    assert (second.record.lease_token, late.record.lease_token) == ("lease-a", "lease-c")
    assert (retry.record.attempt, expired.record.attempt) == (2, 1)


def test_repeated_checkpoint_is_not_a_lost_lease(store: MySQLStore) -> None:
    """Without CLIENT_FOUND_ROWS an identical update counts 0 rows; that is not a loss."""
    clock = FrozenClock()
    record = store.claim(intent(), "lease-a", clock(), clock() + 60).record
    store.checkpoint(record, "charged", clock())
    store.checkpoint(record, "charged", clock())  # same values, same millisecond

    assert store.release(record, clock())
    with pytest.raises(LeaseLost):
        store.checkpoint(record, "charged", clock())


# --- column types ---------------------------------------------------------------------


def test_case_and_trailing_spaces_never_merge_two_keys(store: MySQLStore) -> None:
    """'Key'/'key' and 'k'/'k ' (and principals likewise) are separate intents."""
    idem = Idempotency(store, POLICY)
    cases = [
        ("alice", "Key"),
        ("alice", "key"),
        ("alice", "k"),
        ("alice", "k "),
        ("Alice", "k"),
        ("alice ", "k"),
    ]
    outcomes = [
        idem.run(intent(key, principal=who), Recorder(Response(201, f"{who}/{key}".encode())))
        for who, key in cases
    ]

    assert [o.replayed for o in outcomes] == [False] * len(cases)
    record = store.get("alice", "k ")
    assert record is not None
    assert (record.principal, record.key, record.response) == (
        "alice",
        "k ",
        Response(201, b"alice/k "),
    )


def test_an_over_long_principal_is_an_error_not_a_truncated_claim(store: MySQLStore) -> None:
    """Strict mode and no INSERT IGNORE: a value that does not fit fails loudly."""
    with pytest.raises(pymysql.err.DataError):
        store.claim(intent(principal="p" * 300), "lease-a", 1.0, 100.0)


# --- the caller's transaction -----------------------------------------------------------


@contextlib.contextmanager
def caller(isolation: str) -> Iterator[Any]:
    with contextlib.closing(connect(autocommit=True)) as conn:
        with conn.cursor() as cursor:
            cursor.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
        yield conn


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_completion_commits_with_the_business_write(
    store: MySQLStore, table_name: str, isolation: str
) -> None:
    """Effect and record commit together; a failure rolls both back and releases the key."""
    idem = Idempotency(store, POLICY)
    write = write_business(table_name)

    def fail(attempt: Attempt) -> Response:
        write(attempt.connection, "lost")
        raise RuntimeError("boom")

    def succeed(attempt: Attempt) -> Response:
        write(attempt.connection, "kept")
        return CREATED

    with caller(isolation) as conn:
        with pytest.raises(RuntimeError):
            idem.run(intent(), fail, transaction=PyMySQLTransaction(conn))
        assert business_rows(table_name) == 0
        outcome = idem.run(intent(), succeed, transaction=PyMySQLTransaction(conn))
    assert not outcome.replayed
    assert business_rows(table_name) == 1
    record = store.get("alice", "k-1")
    assert record is not None
    assert (record.state, record.attempt) == (State.COMPLETED, 2)


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_a_duplicate_with_an_old_snapshot_reads_the_current_row(
    store: MySQLStore, table_name: str, isolation: str
) -> None:
    """A caller's transaction that read before the original committed still gets the replay.

    Under REPEATABLE READ the caller's snapshot predates the record: a plain
    SELECT there finds nothing (asserted, so the test exercises the stale
    snapshot); the store's locking read sees the committed row and replays it.
    """
    idem = Idempotency(store, POLICY)
    with caller(isolation) as conn:
        conn.begin()
        with conn.cursor() as cursor:  # the caller's own read fixes its snapshot
            cursor.execute(f"SELECT count(*) FROM {table_name}")
        idem.run(intent(), lambda attempt: CREATED)  # the original, elsewhere, commits
        with conn.cursor() as cursor:
            cursor.execute(store.dialect.select.pyformat, {"principal": "alice", "key": "k-1"})
            plain = cursor.fetchone()
        assert (plain is None) == (isolation == "REPEATABLE READ")

        outcome = idem.run(
            intent(),
            lambda attempt: Response(500),
            transaction=PyMySQLTransaction(conn),
            single_commit=True,
        )
    assert (outcome.replayed, outcome.response) == (True, CREATED)


@pytest.mark.parametrize("isolation", ISOLATION_LEVELS)
def test_single_commit_claim_and_effect_commit_once(
    store: MySQLStore, table_name: str, isolation: str
) -> None:
    """With single_commit the claim joins the caller's transaction: a rollback leaves no key."""
    idem = Idempotency(store, POLICY)
    write = write_business(table_name)

    def fail(attempt: Attempt) -> Response:
        write(attempt.connection, "lost")
        raise RuntimeError("boom")

    with caller(isolation) as conn:
        with pytest.raises(RuntimeError):
            idem.run(intent(), fail, transaction=PyMySQLTransaction(conn), single_commit=True)
        assert store.get("alice", "k-1") is None
        outcome = idem.run(
            intent(),
            Recorder(CREATED, write),
            transaction=PyMySQLTransaction(conn),
            single_commit=True,
        )
    assert not outcome.replayed
    assert business_rows(table_name) == 1


def lock_wait(conn: Any) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
        return int(cursor.fetchone()[0])


def test_single_commit_duplicate_gets_409_without_waiting_long(store: MySQLStore) -> None:
    """A duplicate meeting an uncommitted single-commit claim answers 409 after a bounded wait.

    The bound (1 s) applies to the claim only: the caller's session gets its
    own lock wait back afterwards.
    """
    idem = Idempotency(store, POLICY)
    seen: list[tuple[InProgress, float, int]] = []

    def meanwhile(attempt: Attempt) -> Response:
        with caller("REPEATABLE READ") as other:
            with other.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 7")
            started = time.monotonic()
            with pytest.raises(InProgress) as raised:
                idem.run(
                    intent(), Recorder(), transaction=PyMySQLTransaction(other), single_commit=True
                )
            seen.append((raised.value, time.monotonic() - started, lock_wait(other)))
        return CREATED

    with caller("REPEATABLE READ") as conn:
        before = lock_wait(conn)
        idem.run(intent(), meanwhile, transaction=PyMySQLTransaction(conn), single_commit=True)
        assert lock_wait(conn) == before
    [(error, waited, restored)] = seen
    assert error.status == 409
    assert 0.9 < waited < 5.0
    assert restored == 7


def test_transaction_adapter_joins_a_transaction_already_begun(
    store: MySQLStore, table_name: str
) -> None:
    """The caller's earlier writes are neither committed early nor lost."""
    write = write_business(table_name)
    with caller("REPEATABLE READ") as conn:
        conn.begin()
        write(conn, "before")
        Idempotency(store, POLICY).run(
            intent(),
            Recorder(CREATED, write),
            transaction=PyMySQLTransaction(conn),
        )
    assert business_rows(table_name) == 2


# --- migration and outages ---------------------------------------------------------------------


def test_cli_migrate_creates_table_and_indexes(table_name: str) -> None:
    """`idemflow migrate mysql://…` creates the table and its indexes; a second run is a no-op."""
    command = [sys.executable, "-m", "idemflow", "migrate", MYSQL_URL, "--table", table_name]
    try:
        for _ in range(2):
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute(f"SHOW INDEX FROM {table_name}")
            indexes = {(row[2], row[1]) for row in cursor.fetchall()}
    finally:
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}")
    assert indexes == {
        ("PRIMARY", 0),
        (f"{table_name}_principal_key", 0),
        (f"{table_name}_state_updated", 1),
        (f"{table_name}_state_stale", 1),
        (f"{table_name}_expires", 1),
    }


def nothing_listening() -> str:
    """``host:port`` on loopback where nothing listens (a port just freed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_unreachable_server_is_store_unavailable(tmp_path: Path) -> None:
    """Nothing listening: 503 and the handler never runs."""
    store = MySQLStore(f"mysql://root@{nothing_listening()}/test", timeout=2, clock="caller")
    handler = Recorder()

    with pytest.raises(StoreUnavailable) as raised:
        Idempotency(store, POLICY).run(intent(), handler)
    assert raised.value.status == 503
    assert handler.calls == []


def test_a_refused_connection_behind_sqlalchemy_is_unavailable() -> None:
    """What a SQLAlchemy transaction raises when its engine cannot connect (nothing
    listening): SQLAlchemy's OperationalError around PyMySQL's 2003, which SQLAlchemy
    does not call a disconnect. The store's rule reads the driver's error inside, so the
    driver answers the BEGIN of such a transaction 503, as PostgreSQL's rule does."""
    import sqlalchemy

    from idemflow.stores.mysql import is_unavailable

    engine = sqlalchemy.create_engine(f"mysql+pymysql://root@{nothing_listening()}/test")
    try:
        with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
            engine.connect()
    finally:
        engine.dispose()
    assert not raised.value.connection_invalidated
    assert is_unavailable(raised.value)
    syntax = sqlalchemy.exc.ProgrammingError("SELECT", {}, pymysql.err.ProgrammingError(1064))
    assert not is_unavailable(syntax)


def test_claim_statements_never_use_insert_ignore() -> None:
    """A plain INSERT claims, a guarded upsert takes over: errors stay errors."""
    insert, upsert = mysql_statements("t").insert.named, mysql_dialect("t").claim.named
    assert insert.startswith("INSERT INTO t ")
    assert "IGNORE" not in (insert + upsert).upper()
    assert "DUPLICATE" not in insert
    assert upsert.startswith(insert + " ON DUPLICATE KEY UPDATE ")


# --- races ------------------------------------------------------------------------------------


@contextlib.contextmanager
def caller_transaction() -> Iterator[PyMySQLTransaction]:
    with contextlib.closing(connect(autocommit=True)) as conn:
        yield PyMySQLTransaction(conn)


@pytest.mark.slow
@pytest.mark.parametrize("single_commit", [False, True], ids=["two-commit", "single-commit"])
def test_fifty_threads_race_with_their_own_transactions(
    store: MySQLStore, table_name: str, single_commit: bool
) -> None:
    """52 callers, each on its own connection, claim one key at once, 4 keys: one effect each."""
    rounds = race_threads(
        store,
        table_name,
        rounds=4,
        claimants=52,
        open_transaction=caller_transaction,
        write=write_business(table_name),
        single_commit=single_commit,
    )
    for counts in rounds:
        assert_exactly_once(counts, 52)
    assert business_rows(table_name) == 4


@pytest.mark.slow
def test_four_processes_race_for_each_key(store: MySQLStore, table_name: str) -> None:
    """4 processes × 13 threads claim one key at once, three keys: one execution per key."""
    totals = race_processes(
        ("mysql", (table_name,)), table_name, processes=4, rounds=3, claimants_per_process=13
    )
    for counts in totals.values():
        assert_exactly_once(counts, 52)


def test_unavailable_is_recognised_whichever_copy_of_pymysql_raised_it() -> None:
    """PyMySQL installed as MySQLdb (Django does this) runs pymysql/err.py a second time:
    its errors are other classes of the same names. An outage stays a 503 either way."""
    import types

    from idemflow.stores.mysql import is_unavailable

    # Its source again under another module name, as Django's import makes it (its one
    # relative import, of pymysql.constants, made absolute; nothing enters sys.modules).
    source = (
        Path(pymysql.err.__file__).read_text().replace("from .constants", "from pymysql.constants")
    )
    copy = types.ModuleType("MySQLdb.err")
    exec(compile(source, pymysql.err.__file__, "exec"), copy.__dict__)

    assert copy.OperationalError is not pymysql.err.OperationalError
    assert is_unavailable(copy.OperationalError(2003, "Can't connect to MySQL server"))
    assert is_unavailable(pymysql.err.OperationalError(2013, "Lost connection"))
    assert not is_unavailable(copy.OperationalError(1064, "syntax error"))
    assert not is_unavailable(copy.ProgrammingError(2003, "not an outage class"))


@pytest.mark.parametrize("library", ["django", "sqlalchemy"])
def test_unavailable_is_recognised_behind_a_librarys_wrapper_of_it(library: str) -> None:
    """The caller's transaction adapters raise the driver's error wrapped: Django raises its
    ``django.db.utils`` error from it, SQLAlchemy keeps it as ``.orig``. The store's rule
    judges the error behind the wrapper (a BEGIN that cannot reach the server is a 503)."""
    from idemflow.stores.mysql import error_code, is_unavailable

    def wrapped(error: Exception) -> Any:  # Django's errors are untyped
        if library == "sqlalchemy":
            from sqlalchemy.exc import OperationalError

            return OperationalError("BEGIN", {}, error)
        from django.db.utils import OperationalError as DjangoOperationalError

        try:
            raise DjangoOperationalError(*error.args) from error
        except DjangoOperationalError as exc:
            return exc

    refused = wrapped(pymysql.err.OperationalError(2003, "Can't connect to MySQL server"))
    assert is_unavailable(refused)
    assert error_code(refused) == 2003
    assert is_unavailable(wrapped(pymysql.err.InterfaceError(0, "")))
    assert not is_unavailable(wrapped(pymysql.err.OperationalError(1064, "syntax error")))


def test_a_forked_child_opens_its_own_connections_never_the_parents(store: MySQLStore) -> None:
    # The pool knows its process from a pid kept current at fork (no getpid per
    # checkout): a child must still start empty, not share the parent's socket.
    assert store.get("fork-principal", "fork-key") is None
    parent_thread = store.pool._idle[-1][0].thread_id()
    child = os.fork()
    if child == 0:  # pragma: no cover -- the child reports by its exit status
        code = 1
        try:
            assert store.get("fork-principal", "fork-key") is None
            code = 0 if store.pool._idle[-1][0].thread_id() != parent_thread else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connection was never touched by the child: still usable here.
    assert store.get("fork-principal", "fork-key") is None
    assert store.pool._idle[-1][0].thread_id() == parent_thread


# --- the pool and the claim's INSERT under faults -----------------------------------


class _ScriptedInsert:
    """A real PyMySQL connection whose cursors fail the claim's INSERT with the errors
    of ``script`` (one per INSERT, before it is sent), then send it as usual; every
    statement's first word is kept in ``sent``."""

    def __init__(self, script: list[int], sent: list[str]) -> None:
        self._conn = connect(autocommit=True)
        self._script, self._sent = script, sent

    def cursor(self) -> Any:
        cursor = self._conn.cursor()
        send = cursor.execute

        def execute(query: str, args: Any = None) -> int:
            verb = query.split(None, 1)[0]
            self._sent.append(verb)
            if verb == "INSERT" and self._script:
                code = self._script.pop(0)
                raise pymysql.err.OperationalError(code, f"scripted error {code}")
            return int(send(query, args))

        cursor.execute = execute
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@contextlib.contextmanager
def scripted_store(table_name: str, script: list[int]) -> Iterator[tuple[MySQLStore, list[str]]]:
    sent: list[str] = []
    made = MySQLStore(
        lambda: _ScriptedInsert(script, sent), table=table_name, max_size=1, clock="caller"
    )
    try:
        made.migrate()
        made.get("alice", "k-warm")  # the pool's connection (the migration has its own)
        sent.clear()
        yield made, sent
    finally:
        made.close()
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}")


def test_a_claims_insert_that_lost_a_deadlock_is_sent_again(table_name: str) -> None:
    """A deadlock victim's INSERT had no effect: sent again (five attempts in all),
    and the fifth one's success is the claim."""
    with scripted_store(table_name, [1213] * 4) as (store, sent):
        claim = store.claim(intent(), "lease-1", T0, T0 + 3600)
        assert claim.owned
        assert store.get("alice", "k-1") == claim.record
    assert sent == ["INSERT"] * 5 + ["SELECT"]


def test_a_claims_insert_that_keeps_losing_deadlocks_reads_the_row(table_name: str) -> None:
    """Five lost deadlocks mean another insert of the key won: the row is read (here
    none: claimed again, by an INSERT that now goes through)."""
    with scripted_store(table_name, [1213] * 5) as (store, sent):
        assert store.claim(intent(), "lease-1", T0, T0 + 3600).owned
    assert sent == ["INSERT"] * 5 + ["SELECT", "INSERT"]


def test_a_claims_insert_that_waited_out_its_lock_wait_is_a_409(table_name: str) -> None:
    """Error 1205: a live transaction holds the key's row: InProgress, nothing sent again."""
    with scripted_store(table_name, [1205]) as (store, sent):
        with pytest.raises(InProgress):
            store.claim(intent(), "lease-1", T0, T0 + 3600)
        assert store.get("alice", "k-1") is None
    # The 409 left the claim's block with an error: its connection was closed, and
    # the read opened another (which asks first whether the server is a Galera node).
    assert sent == ["INSERT", "SHOW", "SELECT"]


def test_a_claim_blocked_by_an_uncommitted_insert_of_its_key_is_a_409(table_name: str) -> None:
    """The real lock wait: another session's uncommitted INSERT of the key holds the
    claim's INSERT until ``lock_wait_timeout`` (1 s), then the claim answers 409."""
    from idemflow.stores.sql.dialect import claim_params

    store = MySQLStore(MYSQL_URL, table=table_name, lock_wait_timeout=1, clock="caller")
    store.migrate()
    insert = mysql_statements(table_name, "caller").insert
    try:
        with contextlib.closing(connect()) as other, other.cursor() as cursor:
            cursor.execute("BEGIN")
            params = claim_params(intent(), "lease-other", T0, T0 + 3600)
            cursor.execute(insert.pyformat, insert.bind(params))
            with pytest.raises(InProgress):
                store.claim(intent(), "lease-1", T0, T0 + 3600)
            cursor.execute("ROLLBACK")
        assert store.claim(intent(), "lease-1", T0, T0 + 3600).owned
    finally:
        store.close()
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}")


def test_a_pool_with_every_connection_out_answers_store_unavailable(store: MySQLStore) -> None:
    """Every connection out past the checkout timeout: StoreUnavailable (a 503), and the
    slot comes back with the connection."""
    small = MySQLStore(MYSQL_URL, table=store.dialect.table, max_size=1, timeout=0.2)
    try:
        with small.pool.connection(), pytest.raises(StoreUnavailable, match="busy"):
            small.get("alice", "k-1")
        assert small.get("alice", "k-1") is None
    finally:
        small.close()


def test_a_connection_whose_block_raised_is_closed_not_reused(store: MySQLStore) -> None:
    """Its session (a transaction begun, a result half read) is unknown: never lent again."""
    assert store.get("alice", "k-1") is None
    [(first, _)] = store.pool._idle
    lent: list[Any] = []

    def fail_in_block() -> None:
        with store.pool.connection() as conn:
            lent.append(conn)
            raise RuntimeError("the block failed")

    with pytest.raises(RuntimeError):
        fail_in_block()
    assert lent == [first]
    assert not store.pool._idle
    assert store.get("alice", "k-1") is None
    [(second, _)] = store.pool._idle
    assert second is not first
    assert second.thread_id() != first.thread_id()


def test_an_idle_connection_the_server_dropped_is_replaced(store: MySQLStore) -> None:
    """Idle past PING_AFTER and ended on the server (``wait_timeout``, a restart): the
    checkout's ping fails and a new connection takes its place, so the claim succeeds
    rather than answering 503 (and no DeprecationWarning: no ``ping(reconnect=True)``)."""
    assert store.get("alice", "k-1") is None
    conn, _ = store.pool._idle.pop()
    store.pool._idle.append((conn, -1e9))  # given back long ago, still alive: kept
    assert store.get("alice", "k-1") is None
    assert store.pool._idle[-1][0] is conn
    conn, _ = store.pool._idle.pop()
    ended = conn.thread_id()
    with contextlib.closing(connect()) as admin, admin.cursor() as cursor:
        cursor.execute(f"KILL {ended}")
    store.pool._idle.append((conn, -1e9))  # given back long ago
    assert store.claim(intent(), "lease-1", T0, T0 + 3600).owned
    [(again, _)] = store.pool._idle
    assert again is not conn
    assert again.thread_id() != ended
    assert not conn.open


def _killed(thread_id: int) -> None:
    with contextlib.closing(connect()) as admin, admin.cursor() as cursor:
        cursor.execute(f"KILL {thread_id}")


def _until(condition: Any) -> bool:
    """The server's goodbye reaches the socket a moment after the KILL returns."""
    deadline = time.monotonic() + 5
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_closed_by_server_tells_an_idle_pymysql_connection_the_server_ended() -> None:
    from idemflow.stores.mysql import closed_by_server

    with contextlib.closing(connect()) as conn:
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1")
        assert not closed_by_server(conn)
        _killed(conn.thread_id())
        assert _until(lambda: closed_by_server(conn))


def test_closed_by_server_tells_an_idle_asyncmy_connection_the_server_ended() -> None:
    import asyncio

    asyncmy = pytest.importorskip("asyncmy")
    from idemflow.stores.mysql import closed_by_server

    async def scenario() -> tuple[bool, bool]:
        conn = await asyncmy.connect(**connect_kwargs(MYSQL_URL, "asyncmy"))
        try:
            async with conn.cursor() as cursor:
                await cursor.execute("SELECT CONNECTION_ID()")
                (thread_id,) = await cursor.fetchone()
            alive = closed_by_server(conn)
            _killed(thread_id)
            deadline = time.monotonic() + 5
            while not closed_by_server(conn) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the loop may read the goodbye first
            return alive, closed_by_server(conn)
        finally:
            conn.close()

    alive, ended = asyncio.run(scenario())
    assert not alive
    assert ended


# --- a restart of MariaDB under the store's pool ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_after_a_restart_no_claim_is_refused_for_a_dead_pooled_connection(
    table_name: str, flavour: str
) -> None:
    """MariaDB killed and started again under a store whose pool holds four connections,
    all used a moment ago (so none is old enough to be pinged anyway): each checkout sees
    the server closed its connection (PyMySQL: its socket is readable; asyncmy: its
    protocol saw the end of file), pings it, and opens a new one in its place, so no claim
    is refused (before: a 503 for each of the four)."""
    import asyncio

    from idemflow.stores.mysql import AsyncMySQLStore
    from tests._private_mariadb import PrivateMariaDBUnavailable, private_mariadb

    async def served(store: Any) -> list[bool]:
        async def call(name: str, *args: Any) -> Any:
            result = getattr(store, name)(*args)
            return await result if asyncio.iscoroutine(result) else result

        await call("migrate")
        held = []
        for _ in range(4):  # four connections in the pool, each used just now
            checkout = store.pool.connection()
            held.append((checkout, await _entered(checkout)))
        for checkout, _ in held:
            await _exited(checkout)
        cluster.stop()
        cluster.start()
        answers = []
        for n in range(5):
            now = time.time()
            try:
                claim = await call("claim", intent(f"after-restart-{n}"), "t", now, now + 60)
                answers.append(claim.owned)
            except StoreUnavailable:
                answers.append(False)
        return answers

    async def run() -> list[bool]:
        kind = MySQLStore if flavour == "sync" else AsyncMySQLStore
        store = kind(cluster.url, table=table_name, max_size=4, clock="caller")
        try:
            return await served(store)
        finally:
            closed = store.close()
            if asyncio.iscoroutine(closed):
                await closed

    try:
        with private_mariadb() as cluster:
            answers = asyncio.run(run())
    except PrivateMariaDBUnavailable as exc:
        unreachable("a private MariaDB", exc)

    assert answers == [True] * 5


async def _entered(checkout: Any) -> Any:
    enter = getattr(checkout, "__aenter__", None)
    return await enter() if enter is not None else checkout.__enter__()


async def _exited(checkout: Any) -> None:
    leave = getattr(checkout, "__aexit__", None)
    if leave is not None:
        await leave(None, None, None)
    else:
        checkout.__exit__(None, None, None)
