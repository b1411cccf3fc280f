"""The transaction adapters for psycopg, SQLAlchemy and MySQL (`idemflow.transactions`).
This is the async source of truth; ``idemflow/_sync/transactions.py`` is generated from it
by ``scripts/unasync.py``."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ..stores.protocol import AsyncTransaction, CommitFailed, NotFused, Statement
from ..stores.sql.dialect import row_mapping


class AsyncPsycopgTransaction(AsyncTransaction):
    """A ``psycopg.AsyncConnection``, autocommit or not."""

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def begin(self) -> None:
        # A non-autocommit connection begins by itself on the first statement.
        if self.connection.autocommit:
            await self.connection.execute("BEGIN")

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        cursor = await self.connection.execute(statement.pyformat, statement.bind(params))
        return int(cursor.rowcount)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        cursor = await self.connection.execute(statement.pyformat, statement.bind(params))
        row = await cursor.fetchone()
        return None if row is None else _psycopg_mapping(statement, cursor, row)

    async def commit(self) -> None:
        await self.connection.commit()

    async def rollback(self) -> None:
        await self.connection.rollback()

    async def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The fenced write, its COMMIT (and the next BEGIN) in one round trip: one
        pipeline whose write raises on the server when it changed no row, so the server
        skips the COMMIT and the transaction stays open, failed, for the driver to roll
        back. Values bound on the client (Django's cursors): one simple query, stopped at
        the same error. Without pipeline support in libpq: the write, then ``commit()``."""
        import psycopg

        connection = self.connection
        on_client = issubclass(connection.cursor_factory, psycopg.AsyncClientCursor)
        if not on_client and not _pipelines_supported():
            return await _execute_then_commit(self, statement, params, begin)
        try:
            if on_client:
                ending = "; COMMIT; BEGIN" if begin else "; COMMIT"
                await connection.execute(
                    _fenced(statement.pyformat) + ending, statement.bind(params)
                )
            else:
                async with connection.pipeline():
                    await connection.execute(_fenced(statement.pyformat), statement.bind(params))
                    await connection.execute("COMMIT")
                    if begin:
                        await connection.execute("BEGIN")
        except psycopg.Error as exc:
            if getattr(exc, "sqlstate", None) == "22P02" and _NO_ROW in str(exc):
                return 0  # the fence: nothing committed, the transaction failed and open
            idle = psycopg.pq.TransactionStatus.IDLE
            if connection.info.transaction_status == idle:  # a failed write leaves it open
                raise CommitFailed from exc
            raise
        return 1


#: What the fence of `_fenced` says when the write matched no row.
_NO_ROW = "idemflow: the fenced write matched no row"


@functools.lru_cache(maxsize=64)
def _fenced(update: str) -> str:
    """``update`` (of at most one row, no RETURNING) made to raise when it changes none:
    the cast's input depends on the row count, so it fails at run time, not plan time."""
    return (
        f"WITH fenced AS ({update} RETURNING 1) "
        f"SELECT CAST(CASE COUNT(*) WHEN 1 THEN '1' ELSE '{_NO_ROW}' END AS INTEGER) "
        "FROM fenced"
    )


@functools.cache
def _pipelines_supported() -> bool:
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


async def _execute_then_commit(
    transaction: AsyncTransaction, statement: Statement, params: Mapping[str, Any], begin: bool
) -> int:
    """``execute_and_commit`` in three round trips, for a transaction that cannot send one."""
    changed = await transaction.execute(statement, params)
    if changed != 1:
        return changed
    try:
        await transaction.commit()
        if begin:
            await transaction.begin()
    except Exception as exc:
        raise CommitFailed from exc
    return changed


# Result column names per statement text: psycopg builds ``cursor.description`` afresh
# on every access.
_psycopg_names: dict[str, tuple[str, ...]] = {}


def _psycopg_mapping(statement: Statement, cursor: Any, row: Sequence[Any]) -> Mapping[str, Any]:
    names = _psycopg_names.get(statement.pyformat)
    if names is None:
        names = _psycopg_names[statement.pyformat] = tuple(c[0] for c in cursor.description)
    return dict(zip(names, row, strict=True))


def _as_sqlalchemy_error(error: BaseException | None) -> BaseException | None:
    """psycopg's ``error`` as SQLAlchemy raises it (``IntegrityError`` …, with ``orig``)."""
    import psycopg
    from sqlalchemy.exc import DBAPIError

    if not isinstance(error, psycopg.Error):
        return error
    return DBAPIError.instance(None, None, error, psycopg.Error)


@functools.lru_cache(maxsize=64)
def _text(named: str) -> Any:
    from sqlalchemy import text

    return text(named)


class AsyncSQLAlchemyTransaction(AsyncTransaction):
    """A SQLAlchemy ``AsyncConnection`` or ``AsyncSession``; joins a transaction already begun."""

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self._session = hasattr(connection, "flush")

    async def begin(self) -> None:
        if not self.connection.in_transaction():
            await self.connection.begin()

    async def _run(self, statement: Statement, params: Mapping[str, Any]) -> Any:
        """Run idemflow's statement on a session's connection, in its transaction (not the
        session's ``execute``, which SQLModel's sessions deprecate)."""
        bound = await self.connection.connection() if self._session else self.connection
        return await bound.execute(_text(statement.named), statement.bind(params))

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        return int((await self._run(statement, params)).rowcount)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        row = (await self._run(statement, params)).mappings().fetchone()
        return None if row is None else dict(row)

    async def commit(self) -> None:
        await self.connection.commit()

    @staticmethod
    def is_unavailable(exc: BaseException) -> bool:
        """Does ``exc``, SQLAlchemy's, mean the database cannot serve the request? Its pool
        timed out, or a disconnect (``connection_invalidated``); any other DB-API error is
        the store's rule to judge. Static: a pooled transaction asks the class."""
        from sqlalchemy.exc import DBAPIError, TimeoutError

        if isinstance(exc, TimeoutError):
            return True
        return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)

    async def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The fenced write and its COMMIT in one round trip on PostgreSQL through psycopg 3,
        sent as `AsyncPsycopgTransaction` sends them (a session flushed first); then
        SQLAlchemy's own COMMIT finds nothing to send, and sends the next BEGIN itself.
        psycopg's errors come out as SQLAlchemy's. Anywhere else (another driver, a
        savepoint, ``before_commit`` listeners, statements listened to or echoed,
        autocommit) `NotFused`, before anything is sent."""
        driver = await self._psycopg_connection()
        if driver is None:
            raise NotFused
        import psycopg

        try:
            changed = await AsyncPsycopgTransaction(driver).execute_and_commit(statement, params)
        except CommitFailed as failed:
            raise CommitFailed from _as_sqlalchemy_error(failed.__cause__)
        except psycopg.Error as exc:
            raise _as_sqlalchemy_error(exc) or exc from exc
        if changed != 1:
            return changed  # the fence: nothing committed, the transaction open and failed
        try:
            await self.connection.commit()  # SQLAlchemy's end of it: nothing left to send
            if begin:
                await self.begin()
        except Exception as exc:
            raise CommitFailed from exc
        return changed

    async def _psycopg_connection(self) -> Any:
        """psycopg 3's connection, when a write and its COMMIT may travel together (a
        session's pending changes flushed first: its COMMIT would flush them after)."""
        holder = self.connection
        if holder.in_nested_transaction():
            return None
        session = self._session
        if session:
            if getattr(holder, "sync_session", holder).dispatch.before_commit:
                return None
            bound = await holder.connection()
        else:
            bound = holder
        sync = getattr(bound, "sync_connection", bound)  # an AsyncConnection's Connection
        dialect, dispatch = sync.dialect, sync.dispatch
        if (
            dialect.name != "postgresql"
            or dialect.driver not in ("psycopg", "psycopg_async")
            or sync.invalidated
            or sync.engine.echo
            or dispatch.before_cursor_execute
            or dispatch.after_cursor_execute
            or dispatch.commit
        ):
            return None
        driver = sync.connection.driver_connection
        if driver.autocommit:
            return None
        if session:
            await holder.flush()
        return driver

    async def lend(self, sources: tuple[Any, ...]) -> Any:
        """Nothing (None): a session holding a connection of the claim's pool (one of
        ``sources``) since before the claim (a query first) commits what it began, its
        objects kept loaded, so the claim's checkout takes that connection back: one
        pooled connection per request, never a second while the session holds one."""
        holder = self.connection
        session = getattr(holder, "sync_session", holder)
        if not self._session or not holder.in_transaction():
            return None
        from sqlalchemy.exc import UnboundExecutionError

        try:
            pool = session.get_bind().pool
        except UnboundExecutionError:  # bound per mapper only: none of the store's
            return None
        if pool not in sources:
            return None
        expire, session.expire_on_commit = session.expire_on_commit, False
        try:
            await holder.commit()
        finally:
            session.expire_on_commit = expire
        return None

    async def rollback(self) -> None:
        active = self.connection.in_transaction()
        await self.connection.rollback()
        if not active:  # dropped by a failed COMMIT, but SQLite keeps it (and its lock)
            await self.connection.begin()
            await self.connection.rollback()


_IN_TRANSACTION = 1  # pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS


class AsyncmyTransaction(AsyncTransaction):
    """An asyncmy connection; joins a transaction the caller already began. Any isolation
    level: the store's statements are writes or locking reads, which see the latest row."""

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def begin(self) -> None:
        # BEGIN would silently commit what the caller's transaction already did.
        if not self.connection.server_status & _IN_TRANSACTION:
            await self.connection.begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        async with self.connection.cursor() as cursor:
            return int(await cursor.execute(statement.pyformat, statement.bind(params)))

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        async with self.connection.cursor() as cursor:
            await cursor.execute(statement.pyformat, statement.bind(params))
            row = await cursor.fetchone()
            return None if row is None else row_mapping(cursor.description, row)

    async def commit(self) -> None:
        try:
            await self.connection.commit()
        except Exception as exc:  # a deadlock or failed certification rolled all back: a 503
            from ..stores.mysql import is_conflict, rolled_back

            if is_conflict(exc):
                raise rolled_back() from exc
            raise

    async def rollback(self) -> None:
        await self.connection.rollback()
