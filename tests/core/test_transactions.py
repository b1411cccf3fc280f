"""
Each adapter in ``idemflow.transactions`` puts the completion in the caller's transaction.

For every way a user can hold a connection (raw ``sqlite3``, psycopg in both
autocommit modes, SQLAlchemy ``Connection``/``Session`` and their async twins)
the business write and the completion commit together or not at all:

- success commits both;
- a handler exception rolls back the business write and releases the key;
- a claim lost mid-flight (completion CAS fails) rolls back the business write;
- a COMMIT that fails (a deferred constraint) leaves neither, and the key is
  released, not stuck ``in_progress``;
- a SQLAlchemy transaction the caller already began is joined, never nested.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Idempotency,
    Intent,
    LeaseLost,
    Response,
    State,
)
from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idemflow.testing import FrozenClock
from idemflow.transactions import (
    AsyncPsycopgTransaction,
    AsyncSQLAlchemyTransaction,
    PsycopgTransaction,
    SQLAlchemyTransaction,
    SQLite3Transaction,
)
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import CREATED, POLICY
from tests.sweeping import async_sweep_away, sweep_away

INTENT = Intent("alice", "k-1", "fp-1", endpoint="POST /payments")
ORPHAN = 42  # a parent id that never exists: the deferred foreign key fails at COMMIT


# --- the databases ------------------------------------------------------------


@dataclass
class Database:
    """A key table plus a business table whose deferred foreign key can fail a COMMIT."""

    kind: str  # "sqlite" | "postgres"
    path: str  # SQLite file, or the PostgreSQL URL
    table: str

    @property
    def business(self) -> str:
        return f"biz_{self.table}"

    def insert(self, placeholder: str) -> str:
        return f"INSERT INTO {self.business} (note, parent) VALUES ({placeholder})"

    def notes(self) -> list[str]:
        """Committed business rows, read on a connection of their own."""
        query = f"SELECT note FROM {self.business} ORDER BY id"
        if self.kind == "sqlite":
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                return [row[0] for row in conn.execute(query)]
        import psycopg

        with psycopg.connect(self.path, autocommit=True) as conn:
            return [row[0] for row in conn.execute(query)]

    def sqlalchemy_url(self, *, asynchronous: bool) -> str:
        if self.kind == "sqlite":
            return f"sqlite+{'aiosqlite' if asynchronous else 'pysqlite'}:///{self.path}"
        return self.path.replace("postgresql://", "postgresql+psycopg://", 1)


def business_ddl(db: Database) -> list[str]:
    key = "INTEGER PRIMARY KEY" if db.kind == "sqlite" else "BIGSERIAL PRIMARY KEY"
    return [
        f"CREATE TABLE parent_{db.table} (id INTEGER PRIMARY KEY)",
        f"CREATE TABLE {db.business} (id {key}, note TEXT NOT NULL, parent INTEGER "
        f"REFERENCES parent_{db.table} (id) DEFERRABLE INITIALLY DEFERRED)",
    ]


@contextlib.contextmanager
def sqlite_database(tmp_path: Path, table: str) -> Iterator[Database]:
    db = Database("sqlite", str(tmp_path / "app.db"), table)
    SQLiteStore(db.path, table=table).migrate()
    with contextlib.closing(sqlite3.connect(db.path)) as conn:
        for statement in business_ddl(db):
            conn.execute(statement)
        conn.commit()
    yield db


@contextlib.contextmanager
def postgres_database(table: str) -> Iterator[Database]:
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore

    db = Database("postgres", POSTGRES_URL, table)
    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    with conn:
        store = PostgresStore(POSTGRES_URL, table=table, max_size=1, clock="caller")
        store.migrate()
        store.close()
        for statement in business_ddl(db):
            conn.execute(statement)
        try:
            yield db
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {db.business}, parent_{table}")


def open_database(
    kind: str, tmp_path: Path, table: str
) -> contextlib.AbstractContextManager[Database]:
    return sqlite_database(tmp_path, table) if kind == "sqlite" else postgres_database(table)


# --- the callers: (adapter, database) -----------------------------------------


@dataclass
class Caller:
    """A user's connection in its adapter, and how to write business rows through it."""

    transaction: Any  # Transaction | AsyncTransaction
    write: Callable[[Any, str, int | None], Any]  # (attempt.connection, note, parent)
    in_transaction: Callable[[], bool]
    #: False where a concurrent writer cannot take the claim over mid-transaction
    #: (SQLite's BEGIN IMMEDIATE holds the database's write lock from the start).
    claim_can_be_lost: bool = True


@contextlib.contextmanager
def sqlite3_caller(db: Database, *, immediate: bool) -> Iterator[Caller]:
    conn = sqlite3.connect(db.path, isolation_level=None, timeout=10)
    conn.execute("PRAGMA foreign_keys = ON")
    with contextlib.closing(conn):
        yield Caller(
            SQLite3Transaction(conn, immediate=immediate),
            lambda c, note, parent: c.execute(db.insert("?, ?"), (note, parent)),
            lambda: conn.in_transaction,
            claim_can_be_lost=not immediate,
        )


@contextlib.contextmanager
def psycopg_caller(db: Database, *, autocommit: bool) -> Iterator[Caller]:
    import psycopg

    with psycopg.connect(db.path, autocommit=autocommit) as conn:
        yield Caller(
            PsycopgTransaction(conn),
            lambda c, note, parent: c.execute(db.insert("%s, %s"), (note, parent)),
            lambda: conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE,
        )


def sqlalchemy_engine(db: Database) -> Any:
    import sqlalchemy

    engine = sqlalchemy.create_engine(db.sqlalchemy_url(asynchronous=False))
    if db.kind == "sqlite":
        sqlalchemy.event.listen(engine, "connect", _sqlite_foreign_keys)
    return engine


def _sqlite_foreign_keys(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.execute("PRAGMA foreign_keys = ON")


def sqlalchemy_write(db: Database) -> Callable[[Any, str, int | None], Any]:
    from sqlalchemy import text

    statement = text(db.insert(":note, :parent"))
    return lambda c, note, parent: c.execute(statement, {"note": note, "parent": parent})


@contextlib.contextmanager
def sqlalchemy_caller(db: Database, *, session: bool) -> Iterator[Caller]:
    from sqlalchemy.orm import Session

    engine = sqlalchemy_engine(db)
    try:
        with contextlib.ExitStack() as stack:
            holder = stack.enter_context(Session(engine) if session else engine.connect())
            yield Caller(SQLAlchemyTransaction(holder), sqlalchemy_write(db), holder.in_transaction)
    finally:
        engine.dispose()


SYNC_CALLERS: dict[str, Callable[[Database], contextlib.AbstractContextManager[Caller]]] = {
    "sqlite3-deferred": lambda db: sqlite3_caller(db, immediate=False),
    "sqlite3-immediate": lambda db: sqlite3_caller(db, immediate=True),
    "psycopg-autocommit": lambda db: psycopg_caller(db, autocommit=True),
    "psycopg-transactional": lambda db: psycopg_caller(db, autocommit=False),
    "sqlalchemy-connection": lambda db: sqlalchemy_caller(db, session=False),
    "sqlalchemy-session": lambda db: sqlalchemy_caller(db, session=True),
}

SYNC_CASES = [
    ("sqlite", "sqlite3-deferred"),
    ("sqlite", "sqlite3-immediate"),
    ("postgres", "psycopg-autocommit"),
    ("postgres", "psycopg-transactional"),
    ("sqlite", "sqlalchemy-connection"),
    ("sqlite", "sqlalchemy-session"),
    ("postgres", "sqlalchemy-connection"),
    ("postgres", "sqlalchemy-session"),
]


@dataclass
class Setup:
    db: Database
    caller: Caller
    store: Any
    clock: FrozenClock

    def idempotency(self) -> Any:
        return Idempotency(self.store, POLICY, clock=self.clock)


@contextlib.contextmanager
def sync_store(db: Database) -> Iterator[Any]:
    if db.kind == "sqlite":
        yield SQLiteStore(db.path, table=db.table)
        return
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(db.path, table=db.table, max_size=2, clock="caller")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=SYNC_CASES, ids=lambda case: f"{case[1]}-{case[0]}")
def setup(request: pytest.FixtureRequest, tmp_path: Path, table_name: str) -> Iterator[Setup]:
    kind, adapter = request.param
    with contextlib.ExitStack() as stack:
        db = stack.enter_context(open_database(kind, tmp_path, table_name))
        store = stack.enter_context(sync_store(db))
        caller = stack.enter_context(SYNC_CALLERS[adapter](db))
        yield Setup(db, caller, store, FrozenClock())


def state_of(store: Any) -> State | None:
    record = store.get(INTENT.principal, INTENT.key)
    return None if record is None else record.state


# --- sync scenarios -------------------------------------------------------------


def test_success_commits_the_effect_and_the_completion(setup: Setup) -> None:
    """The business row and the completed record are both committed."""

    def handler(attempt: Attempt) -> Response:
        setup.caller.write(attempt.connection, "paid", None)
        return CREATED

    outcome = setup.idempotency().run(INTENT, handler, transaction=setup.caller.transaction)

    assert (outcome.response, outcome.replayed) == (CREATED, False)
    assert setup.db.notes() == ["paid"]
    record = setup.store.get("alice", "k-1")
    assert (record.state, record.response) == (State.COMPLETED, CREATED)
    assert not setup.caller.in_transaction()


def test_handler_exception_rolls_back_and_releases(setup: Setup) -> None:
    """The business write is undone, the key is released and the error passes unchanged."""
    boom = RuntimeError("boom")

    def handler(attempt: Attempt) -> Response:
        setup.caller.write(attempt.connection, "half-done", None)
        raise boom

    with pytest.raises(RuntimeError) as raised:
        setup.idempotency().run(INTENT, handler, transaction=setup.caller.transaction)

    assert raised.value is boom
    assert setup.db.notes() == []
    assert state_of(setup.store) is State.RELEASED
    assert not setup.caller.in_transaction()


def test_lost_claim_rolls_back_the_effect(setup: Setup) -> None:
    """Taken over mid-flight: the completion CAS fails and the business write never commits."""
    if not setup.caller.claim_can_be_lost:
        pytest.skip("BEGIN IMMEDIATE holds SQLite's write lock: no takeover can interleave")

    def handler(attempt: Attempt) -> Response:
        setup.clock.advance(3601)  # past the stale threshold: the sweeper ends our claim
        now = setup.clock()
        assert len(sweep_away(setup.store, now)) == 1
        assert setup.store.claim(INTENT, "thief", now, now + 3600).owned
        setup.caller.write(attempt.connection, "second effect", None)
        return CREATED

    with pytest.raises(LeaseLost):
        setup.idempotency().run(INTENT, handler, transaction=setup.caller.transaction)

    assert setup.db.notes() == []
    record = setup.store.get("alice", "k-1")
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "thief")
    assert not setup.caller.in_transaction()


def test_failed_commit_stores_nothing_and_releases(setup: Setup) -> None:
    """A COMMIT refused by a deferred constraint leaves no effect, no completion, a free key."""

    def handler(attempt: Attempt) -> Response:
        setup.caller.write(attempt.connection, "orphan", ORPHAN)
        return CREATED

    with pytest.raises(Exception, match=r"(?i)foreign key") as raised:
        setup.idempotency().run(INTENT, handler, transaction=setup.caller.transaction)

    assert not isinstance(raised.value, LeaseLost)
    assert setup.db.notes() == []
    assert state_of(setup.store) is State.RELEASED  # not stuck in_progress until the sweeper
    assert not setup.caller.in_transaction()
    retry = setup.idempotency().run(INTENT, lambda attempt: CREATED)
    assert (retry.response, retry.replayed) == (CREATED, False)


# --- SQLAlchemy: join the caller's transaction, never nest ----------------------


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("session", [False, True], ids=["connection", "session"])
@pytest.mark.parametrize("fails", [False, True], ids=["commit", "rollback"])
def test_sqlalchemy_joins_a_transaction_already_begun(
    tmp_path: Path, table_name: str, kind: str, session: bool, fails: bool
) -> None:
    """Work the caller did before ``run`` commits or rolls back with the handler's.

    On SQLite the earlier statement is a read: a write would hold the file's
    only write lock and queue the claim behind it (see SQLite3Transaction).
    """
    with contextlib.ExitStack() as stack:
        db = stack.enter_context(open_database(kind, tmp_path, table_name))
        store = stack.enter_context(sync_store(db))
        caller = stack.enter_context(sqlalchemy_caller(db, session=session))
        holder = caller.transaction.connection
        earlier_write = kind == "postgres"
        if earlier_write:
            caller.write(holder, "before", None)
        else:
            holder.execute(_select_one())
        outer = holder.get_transaction()
        assert outer is not None

        def handler(attempt: Attempt) -> Response:
            assert attempt.connection is holder
            assert holder.get_transaction() is outer
            assert not holder.in_nested_transaction()
            caller.write(holder, "during", None)
            if fails:
                raise RuntimeError("boom")
            return CREATED

        idem = Idempotency(store, POLICY, clock=FrozenClock())
        with contextlib.suppress(RuntimeError):
            idem.run(INTENT, handler, transaction=caller.transaction)

        expected = [] if fails else (["before", "during"] if earlier_write else ["during"])
        assert db.notes() == expected
        assert state_of(store) is (State.RELEASED if fails else State.COMPLETED)
        assert not holder.in_transaction()


def _select_one() -> Any:
    from sqlalchemy import text

    return text("SELECT 1")


# --- async adapters -----------------------------------------------------------


@contextlib.asynccontextmanager
async def async_psycopg_caller(db: Database, *, autocommit: bool) -> AsyncIterator[Caller]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(db.path, autocommit=autocommit) as conn:

        async def write(c: Any, note: str, parent: int | None) -> None:
            await c.execute(db.insert("%s, %s"), (note, parent))

        yield Caller(
            AsyncPsycopgTransaction(conn),
            write,
            lambda: conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE,
        )


@contextlib.asynccontextmanager
async def async_sqlalchemy_caller(db: Database, *, session: bool) -> AsyncIterator[Caller]:
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(db.sqlalchemy_url(asynchronous=True))
    if db.kind == "sqlite":
        sqlalchemy.event.listen(engine.sync_engine, "connect", _sqlite_foreign_keys)
    statement = sqlalchemy.text(db.insert(":note, :parent"))

    async def write(c: Any, note: str, parent: int | None) -> None:
        await c.execute(statement, {"note": note, "parent": parent})

    try:
        async with contextlib.AsyncExitStack() as stack:
            opened: Any = AsyncSession(engine) if session else engine.connect()
            holder = await stack.enter_async_context(opened)
            yield Caller(AsyncSQLAlchemyTransaction(holder), write, holder.in_transaction)
    finally:
        await engine.dispose()


ASYNC_CASES = [
    ("postgres", "async-psycopg-autocommit"),
    ("postgres", "async-psycopg-transactional"),
    ("sqlite", "async-sqlalchemy-connection"),
    ("sqlite", "async-sqlalchemy-session"),
    ("postgres", "async-sqlalchemy-connection"),
    ("postgres", "async-sqlalchemy-session"),
]

ASYNC_CALLERS: dict[str, Callable[[Database], contextlib.AbstractAsyncContextManager[Caller]]] = {
    "async-psycopg-autocommit": lambda db: async_psycopg_caller(db, autocommit=True),
    "async-psycopg-transactional": lambda db: async_psycopg_caller(db, autocommit=False),
    "async-sqlalchemy-connection": lambda db: async_sqlalchemy_caller(db, session=False),
    "async-sqlalchemy-session": lambda db: async_sqlalchemy_caller(db, session=True),
}


@contextlib.asynccontextmanager
async def async_store(db: Database) -> AsyncIterator[Any]:
    if db.kind == "sqlite":
        yield AsyncSQLiteStore(db.path, table=db.table)
        return
    from idemflow.stores.postgres import AsyncPostgresStore

    store = AsyncPostgresStore(db.path, table=db.table, max_size=2, clock="caller")
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def async_setup(case: tuple[str, str], tmp_path: Path, table: str) -> AsyncIterator[Setup]:
    kind, adapter = case
    with open_database(kind, tmp_path, table) as db:
        async with async_store(db) as store, ASYNC_CALLERS[adapter](db) as caller:
            yield Setup(db, caller, store, FrozenClock())


def async_idempotency(setup: Setup) -> AsyncIdempotency:
    return AsyncIdempotency(setup.store, POLICY, clock=setup.clock)


async def async_state_of(store: Any) -> State | None:
    record = await store.get(INTENT.principal, INTENT.key)
    return None if record is None else record.state


ASYNC_IDS = [f"{adapter}-{kind}" for kind, adapter in ASYNC_CASES]


@pytest.mark.anyio
@pytest.mark.parametrize("case", ASYNC_CASES, ids=ASYNC_IDS)
async def test_async_success_commits_the_effect_and_the_completion(
    case: tuple[str, str], tmp_path: Path, table_name: str
) -> None:
    """Async adapters commit the business row and the completed record together."""
    async with async_setup(case, tmp_path, table_name) as setup:

        async def handler(attempt: AsyncAttempt) -> Response:
            await setup.caller.write(attempt.connection, "paid", None)
            return CREATED

        idem = async_idempotency(setup)
        outcome = await idem.run(INTENT, handler, transaction=setup.caller.transaction)

        assert (outcome.response, outcome.replayed) == (CREATED, False)
        assert setup.db.notes() == ["paid"]
        assert await async_state_of(setup.store) is State.COMPLETED
        assert not setup.caller.in_transaction()


@pytest.mark.anyio
@pytest.mark.parametrize("case", ASYNC_CASES, ids=ASYNC_IDS)
async def test_async_handler_exception_rolls_back_and_releases(
    case: tuple[str, str], tmp_path: Path, table_name: str
) -> None:
    """Async adapters roll the business write back and release the key on an exception."""
    async with async_setup(case, tmp_path, table_name) as setup:
        boom = RuntimeError("boom")

        async def handler(attempt: AsyncAttempt) -> Response:
            await setup.caller.write(attempt.connection, "half-done", None)
            raise boom

        with pytest.raises(RuntimeError) as raised:
            await async_idempotency(setup).run(
                INTENT, handler, transaction=setup.caller.transaction
            )

        assert raised.value is boom
        assert setup.db.notes() == []
        assert await async_state_of(setup.store) is State.RELEASED
        assert not setup.caller.in_transaction()


@pytest.mark.anyio
@pytest.mark.parametrize("case", ASYNC_CASES, ids=ASYNC_IDS)
async def test_async_lost_claim_rolls_back_the_effect(
    case: tuple[str, str], tmp_path: Path, table_name: str
) -> None:
    """Async adapters: a claim taken over mid-flight cannot commit its business write."""
    async with async_setup(case, tmp_path, table_name) as setup:

        async def handler(attempt: AsyncAttempt) -> Response:
            setup.clock.advance(3601)  # past the stale threshold: the sweeper ends our claim
            now = setup.clock()
            assert len(await async_sweep_away(setup.store, now)) == 1
            assert (await setup.store.claim(INTENT, "thief", now, now + 3600)).owned
            await setup.caller.write(attempt.connection, "second effect", None)
            return CREATED

        with pytest.raises(LeaseLost):
            await async_idempotency(setup).run(
                INTENT, handler, transaction=setup.caller.transaction
            )

        assert setup.db.notes() == []
        record = await setup.store.get("alice", "k-1")
        assert (record.state, record.lease_token) == (State.IN_PROGRESS, "thief")
        assert not setup.caller.in_transaction()


@pytest.mark.anyio
@pytest.mark.parametrize("case", ASYNC_CASES, ids=ASYNC_IDS)
async def test_async_failed_commit_stores_nothing_and_releases(
    case: tuple[str, str], tmp_path: Path, table_name: str
) -> None:
    """Async adapters: a COMMIT refused by a deferred constraint leaves a free key."""
    async with async_setup(case, tmp_path, table_name) as setup:

        async def handler(attempt: AsyncAttempt) -> Response:
            await setup.caller.write(attempt.connection, "orphan", ORPHAN)
            return CREATED

        with pytest.raises(Exception, match=r"(?i)foreign key"):
            await async_idempotency(setup).run(
                INTENT, handler, transaction=setup.caller.transaction
            )

        assert setup.db.notes() == []
        assert await async_state_of(setup.store) is State.RELEASED
        assert not setup.caller.in_transaction()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("session", [False, True], ids=["connection", "session"])
async def test_async_sqlalchemy_joins_a_transaction_already_begun(
    tmp_path: Path, table_name: str, kind: str, session: bool
) -> None:
    """An AsyncConnection/AsyncSession that already began is joined: one transaction."""
    adapter = "async-sqlalchemy-session" if session else "async-sqlalchemy-connection"
    async with async_setup((kind, adapter), tmp_path, table_name) as setup:
        holder = setup.caller.transaction.connection
        earlier_write = kind == "postgres"
        if earlier_write:
            await setup.caller.write(holder, "before", None)
        else:
            await holder.execute(_select_one())
        outer = holder.get_transaction()
        assert outer is not None

        async def handler(attempt: AsyncAttempt) -> Response:
            assert holder.get_transaction() is outer
            assert not holder.in_nested_transaction()
            await setup.caller.write(attempt.connection, "during", None)
            return CREATED

        await async_idempotency(setup).run(INTENT, handler, transaction=setup.caller.transaction)

        assert setup.db.notes() == (["before", "during"] if earlier_write else ["during"])
        assert not holder.in_transaction()


def test_single_commit_is_refused_where_duplicates_would_queue(tmp_path: Path) -> None:
    """SQLite admits one writer: single-commit mode is a configuration error there."""
    from idemflow import ConfigurationError, Idempotency, Intent, Response
    from idemflow.stores.sqlite import SQLiteStore
    from idemflow.transactions import SQLite3Transaction

    path = tmp_path / "keys.db"
    store = SQLiteStore(path)
    store.migrate()
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(ConfigurationError, match="single_commit"):
        Idempotency(store).run(
            Intent("alice", "k", "fp"),
            lambda attempt: Response(201),
            transaction=SQLite3Transaction(conn),
            single_commit=True,
        )
    conn.close()
    assert store.get("alice", "k") is None


@pytest.mark.parametrize("bound", ["the_stores_pool", "another_pool", "per_mapper"])
def test_a_session_lends_nothing_and_gives_its_connection_back_to_the_stores_pool(
    tmp_path: Path, bound: str
) -> None:
    """``SQLAlchemyTransaction.lend``: a session that began before the claim on the store's
    pool commits what it began, so the claim's checkout takes
    that connection back; on another pool, or bound per mapper only, it is left alone."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import QueuePool

    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    other = create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    session = Session(
        bind=None if bound == "per_mapper" else engine,
        expire_on_commit=True,
    )
    if bound == "per_mapper":
        session.begin()
    else:
        session.execute(text("SELECT 1"))
    sources = (other.pool,) if bound == "another_pool" else (engine.pool,)

    lent = SQLAlchemyTransaction(session).lend(sources)

    assert lent is None
    assert session.in_transaction() is (bound != "the_stores_pool")
    assert session.expire_on_commit  # as it was
    assert isinstance(engine.pool, QueuePool)  # a file's engine: connections checked out
    assert engine.pool.checkedout() == (1 if bound == "another_pool" else 0)
    session.close()
    engine.dispose()
    other.dispose()
