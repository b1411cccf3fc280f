"""Key records in the Django project's own database, on Django's connections: `DjangoStore`
and `DjangoTransaction`, the view's ``transaction.atomic()`` it completes in. Which connection
a statement runs on: docs/frameworks/django.md, "Transactions, ``ATOMIC_REQUESTS`` and what
commits when"."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._errors import ConfigurationError
from .._extras import optional
from .._model import DEFAULT_STALE_SECONDS, Claim, Intent
from ..transactions import PsycopgTransaction
from . import mysql, postgres, sqlite
from .protocol import (
    CommitFailed,
    NotFused,
    Statement,
    Transaction,
    check_clock,
)
from .sql import Dialect, SQLStore

with optional("idemflow.stores.django"):
    from django.db import DEFAULT_DB_ALIAS, connections
    from django.db import transaction as django_transaction
    from django.db.utils import InterfaceError, OperationalError

__all__ = ["DjangoStore"]

DEFAULT_TABLE = "idemflow_keys"


def _cause(exc: BaseException) -> BaseException:
    """The driver's own error behind Django's wrapper (``django.db.utils.*``)."""
    return exc.__cause__ if exc.__cause__ is not None else exc


def _unavailable(vendor: str) -> Callable[[BaseException], bool]:
    """Driver errors that mean "cannot reach the key store": a 503, fail closed."""

    def check(exc: BaseException) -> bool:
        if isinstance(exc, InterfaceError):
            return True
        if not isinstance(exc, OperationalError):
            return False
        if vendor == "sqlite":
            return sqlite.is_unavailable(_cause(exc))
        if vendor == "mysql":
            return mysql.error_code(exc) in mysql.UNAVAILABLE_CODES
        return True  # PostgreSQL: as PostgresStore, any OperationalError is an outage

    return check


def _pg_lock_timeout(exc: BaseException) -> bool:
    """SQLSTATE 55P03 from psycopg 3 (``sqlstate``) or psycopg2 (``pgcode``)."""
    cause = _cause(exc)
    return (getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)) == "55P03"


# --- connections --------------------------------------------------------------------------


class _SideConnections:
    """One extra connection per (thread, alias), in autocommit, with bounded lock waits: of
    its thread, as Django's connections are; closed once it raised (the next use reconnects)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, using: str) -> Any:
        opened: dict[str, Any] = self._local.__dict__.setdefault("opened", {})
        conn = opened.get(using)
        if conn is None:
            conn = opened[using] = connections.create_connection(using)
        if conn.connection is None:
            conn.ensure_connection()
            with conn.cursor() as cursor:
                for statement in _session_bounds(conn.vendor):
                    cursor.execute(statement)
        return conn

    def discard(self, using: str) -> None:
        conn = self._local.__dict__.get("opened", {}).pop(using, None)
        if conn is not None:
            conn.close()


def _session_bounds(vendor: str) -> tuple[str, ...]:
    if vendor == "postgresql":
        return (f"SET lock_timeout = '{postgres.DEFAULT_CLAIM_LOCK_TIMEOUT_MS}ms'",)
    if vendor == "mysql":
        return (f"SET SESSION innodb_lock_wait_timeout = {mysql.DEFAULT_LOCK_WAIT_TIMEOUT}",)
    return ()


_side = _SideConnections()

#: The connection a lent claim runs on, per thread: ``{alias: connection}`` while
#: `DjangoStore.claim_on_lent` claims alone on the request's own connection.
_lent = threading.local()


def _pooled(using: str) -> bool:
    """Does the alias take its connections from Django's pool (``OPTIONS["pool"]``)?"""
    return bool(connections.settings[using].get("OPTIONS", {}).get("pool"))


def _busy(conn: Any) -> bool:
    """Is the thread's connection inside a transaction (an atomic block, or autocommit off)?"""
    if conn.in_atomic_block:
        return True
    if conn.connection is None:
        conn.ensure_connection()  # what getautocommit() does first
    return not conn.autocommit


class store_connection:
    """The connection a store statement runs on (see the module's docstring); a class, not a
    generator: it is entered for every claim."""

    __slots__ = ("_always_side", "_side", "_using")

    def __init__(self, using: str, *, always_side: bool) -> None:
        self._using = using
        self._always_side = always_side
        self._side = False

    def __enter__(self) -> Any:
        lent = _lent.__dict__.get(self._using)
        if lent is not None:
            return lent
        shared = connections[self._using]
        if not self._always_side and not _busy(shared):
            return shared
        self._side = True
        return _side.get(self._using)

    def __exit__(self, kind: Any, exc: Any, traceback: Any) -> None:
        # Its session state is unknown after an error; a pooled one goes back to
        # Django's pool after each use, never held between requests.
        if self._side and (kind is not None or _pooled(self._using)):
            _side.discard(self._using)


class _Pool:
    """What `MySQLStore` asks of its pool, on Django's connections."""

    def __init__(self, using: str) -> None:
        self.using = using

    def connection(self) -> Any:
        return store_connection(self.using, always_side=True)

    def close(self) -> None:
        _side.discard(self.using)


def dialect_for(vendor: str, table: str, clock: str = "caller") -> Dialect:
    """The statements idemflow's own store for ``vendor`` runs (DDL included)."""
    if vendor == "mysql":
        return mysql.mysql_dialect(table, check_clock(clock))
    if vendor == "postgresql":
        return postgres.postgres_dialect(
            table, postgres.DEFAULT_CLAIM_LOCK_TIMEOUT_MS, check_clock(clock)
        )
    if vendor == "sqlite":
        # SQLite has no server clock to move to: the caller's is the only one.
        return sqlite.sqlite_dialect(table)
    msg = f"DjangoStore supports PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}"
    raise ConfigurationError(msg)


def _never(exc: BaseException) -> bool:
    return False  # SQLite: one writer, no lock wait to bound


class DjangoStore(SQLStore):
    """Key records in the ``DATABASES`` alias ``using`` (the key table, created by
    ``manage.py migrate``, and the completion live there), on Django's connections.
    ``clock``: ``"database"`` (default) takes every time decision on the server's clock
    (PostgreSQL, MySQL); ``"caller"`` on the ``now`` each call passes (SQLite's only)."""

    def __new__(cls, using: str = DEFAULT_DB_ALIAS, **_: Any) -> DjangoStore:
        # On MySQL, MySQLStore's claim algorithm: the same store, one class below.
        mine = _MySQL if cls is DjangoStore and connections[using].vendor == "mysql" else cls
        return super().__new__(mine)

    def __init__(
        self, using: str = DEFAULT_DB_ALIAS, *, table: str = DEFAULT_TABLE, clock: str = "database"
    ) -> None:
        self.using = using
        self.table = table
        vendor = self.vendor
        lock_timeout = {"postgresql": _pg_lock_timeout, "mysql": mysql.is_contention}
        # Django's cursors take %(name)s on every backend (its SQLite wrapper converts them)
        # and ignore parameters a statement does not name.
        SQLStore.__init__(  # not super(): on MySQL, MySQLStore's __init__ comes next
            self,
            dialect_for(vendor, table, clock),
            functools.partial(store_connection, using, always_side=vendor == "mysql"),
            paramstyle="pyformat",
            is_unavailable=_unavailable(vendor),
            is_lock_timeout=lock_timeout.get(vendor, _never),
            extra_params=True,
        )

    @property
    def vendor(self) -> str:
        return str(connections[self.using].vendor)

    @functools.cached_property  # every request asks; the dialect is fixed
    def supports_single_commit(self) -> bool:
        return bool(super().supports_single_commit)

    @functools.cached_property
    def _lends(self) -> bool:
        """On PostgreSQL (the vendor Django pools), a claim runs on the request's connection."""
        return self.vendor == "postgresql"

    def claim_on_lent(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        lender: Transaction,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        """`claim`, on the connection the request's Django transaction uses.

        Inside an atomic block whose transaction has sent nothing yet, the claim commits
        alone on the request's own connection (one connection per request, a duplicate
        sees it at once); once it has begun, on the side connection. Never as one of the
        request's writes: it would vanish with a crash after an external call.
        """
        conn = lender.lend((self.using,)) if self._lends else None
        raw = idle_psycopg3(conn) if conn is not None and conn.in_atomic_block else None
        if raw is None:  # not lent, or begun on the server: alone, on `store_connection`'s
            return self.claim(intent, lease_token, now, expires_at, stale_after=stale_after)
        _lent.__dict__[self.using] = conn
        try:
            with autocommit(raw):
                return self.claim(intent, lease_token, now, expires_at, stale_after=stale_after)
        finally:
            del _lent.__dict__[self.using]

    def close(self) -> None:
        """Close this thread's side connection (the thread's own belongs to Django)."""
        _side.discard(self.using)


class _MySQL(DjangoStore, mysql.MySQLStore):
    """`DjangoStore` on MySQL: MySQLStore's claim algorithm on Django's connections.
    ``MySQLStore.__init__`` is not called: its pool would hand one thread's connection
    to another, which Django's connections refuse."""

    supports_single_commit = True  # MySQLStore's

    def __init__(
        self, using: str = DEFAULT_DB_ALIAS, *, table: str = DEFAULT_TABLE, clock: str = "database"
    ) -> None:
        self.statements = mysql.mysql_statements(table, check_clock(clock))
        self.lock_wait_timeout = mysql.DEFAULT_LOCK_WAIT_TIMEOUT
        self.pool = _Pool(using)  # type: ignore[assignment]
        super().__init__(using, table=table, clock=clock)


# --- the view's transaction ---------------------------------------------------------------


def idle_psycopg3(conn: Any) -> Any:
    """psycopg 3's connection under ``conn``, if no transaction is open on the server
    (psycopg sends Django's BEGIN with the first statement: until then a statement
    may commit alone, in autocommit).
    """
    raw = conn.connection
    if raw is None or not is_psycopg3(raw) or conn.needs_rollback or raw.autocommit:
        return None
    from psycopg.pq import TransactionStatus

    return raw if raw.info.transaction_status == TransactionStatus.IDLE else None


@contextmanager
def autocommit(raw: Any) -> Iterator[None]:
    """psycopg 3's ``raw`` in autocommit for the block (Django's bookkeeping unchanged)."""
    raw.autocommit = True
    try:
        yield
    finally:
        if not raw.closed and not raw.broken:  # a connection gone: Django closes it
            raw.autocommit = False


def is_psycopg3(raw: Any) -> bool:
    """Is ``raw`` a psycopg 3 connection (not psycopg2's)?"""
    return type(raw).__module__.split(".", 1)[0] == "psycopg"


_SQLITE_NESTED = (
    "idemflow cannot run inside an enclosing atomic block on SQLite (ATOMIC_REQUESTS, or "
    "your own transaction.atomic()): SQLite admits one writer, so the key could not be "
    "claimed or given back while the request's transaction writes. Decorate the view "
    "function with @idempotent (it opts out of ATOMIC_REQUESTS and runs the view in a "
    "transaction of its own), or use PostgreSQL or MySQL"
)


class _Rollback(Exception):
    """Passed to ``Atomic.__exit__`` to make it roll back."""


def _as_django_error(conn: Any, error: BaseException | None) -> BaseException | None:
    """``error`` (psycopg's) as Django's wrapper of it, as a cursor or ``commit()`` raises it."""
    if error is None:
        return None
    try:
        with conn.wrap_database_errors:
            raise error
    except Exception as wrapped:  # noqa: BLE001 -- what the wrapper made of it
        return wrapped
    return error  # pragma: no cover -- the block above always raises


class DjangoTransaction(Transaction):
    """The view's ``transaction.atomic()`` on ``connections[using]``, as the driver needs it:
    an outermost ``atomic``, or a savepoint inside an enclosing one (docs/frameworks/django.md,
    "Transactions, ``ATOMIC_REQUESTS`` and what commits when")."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using
        self._atomic: Any = None
        self._nested = False
        self._detached = False
        # Did DjangoStore.claim_on_lent commit the claim alone on this very connection,
        # inside an enclosing atomic block, before its transaction began on the server?
        self._claimed_alone = False
        # After a rollback, statements run on this connection in autocommit: the claim
        # was committed alone and the enclosing transaction, holding nothing, ended.
        self._alone: Any = None
        # This thread's connections[using], kept from begin: the lookup costs
        # more than a statement's own Python (the transaction lives in one thread).
        self._conn: Any = None

    @property
    def connection(self) -> Any:
        """``connections[using]``: what the ORM in the view writes through anyway."""
        return connections[self.using]

    @property
    def nested(self) -> bool:
        """Did the last ``begin`` open a savepoint inside an enclosing atomic block?"""
        return self._nested

    def lend(self, sources: tuple[Any, ...]) -> Any:
        """This thread's ``connections[using]`` for the claim, when its alias is a source."""
        if self.using not in sources:
            return None
        conn = connections[self.using]
        # DjangoStore.claim_on_lent commits the claim alone on it exactly when its
        # atomic block has not begun on the server (the store is the only lender's
        # borrower: no other store names an alias among its sources).
        self._claimed_alone = conn.in_atomic_block and idle_psycopg3(conn) is not None
        return conn

    def begin(self) -> None:
        if self._detached or self._alone is not None:
            return  # autocommit: nothing to begin
        conn = self._conn = connections[self.using]
        self._nested = conn.in_atomic_block
        if self._nested and conn.vendor == "sqlite":
            # One writer: the release would queue behind the enclosing transaction's
            # write lock, so it goes (now, before any write of ours) through the side
            # connection, and the attempt is refused.
            self._detached = True
            raise ConfigurationError(_SQLITE_NESTED)
        atomic = django_transaction.atomic(using=self.using)
        atomic.__enter__()
        self._atomic = atomic

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        with self._cursor() as cursor:
            cursor.execute(statement.pyformat, params)  # Django's cursors ignore extras
            return int(cursor.rowcount)

    def fetchone(self, statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        with self._cursor() as cursor:
            cursor.execute(statement.pyformat, params)  # Django's cursors ignore extras
            row = cursor.fetchone()
            if row is None:
                return None
            return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}

    def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The fenced write and its COMMIT in one round trip (``PsycopgTransaction``'s), on
        the psycopg 3 connection under Django's, which then ends its ``atomic`` block;
        `NotFused` wherever `_psycopg_connection` finds none, before anything is sent."""
        raw = self._psycopg_connection()
        if raw is None:
            raise NotFused
        conn = self._conn
        try:
            with conn.wrap_database_errors:  # psycopg's errors as Django's cursors raise them
                changed = PsycopgTransaction(raw).execute_and_commit(statement, params)
        except CommitFailed as failed:
            raise CommitFailed from _as_django_error(conn, failed.__cause__)
        if changed != 1:
            return changed  # the fence: nothing committed, the transaction open and failed
        try:
            self.commit()  # the atomic block's end: no COMMIT left to send, on_commit runs
            if begin:
                self.begin()
        except Exception as exc:
            raise CommitFailed from exc
        return changed

    def commit(self) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        atomic.__exit__(None, None, None)

    def rollback(self) -> None:
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return  # already ended (a failed COMMIT rolls back by itself)
        atomic.__exit__(_Rollback, _Rollback(), None)
        if not self._nested:
            return
        if self._claimed_alone:
            # The claim committed before the enclosing transaction began, and the rollback
            # to our savepoint left nothing in it: end it on the server, and give the key
            # back in autocommit on this very connection (Django's atomic block goes on).
            raw = self._conn.connection if self._conn is not None else None
            try:
                if raw is not None and is_psycopg3(raw):
                    raw.rollback()
                    self._alone = raw
                    return
            except Exception:  # noqa: BLE001 -- a connection gone: the side connection's turn
                pass
        self._detached = True

    def _psycopg_connection(self) -> Any:
        """psycopg 3's connection, when a write and the COMMIT after it may travel together:
        Django's one outermost ``atomic`` block on PostgreSQL, not marked for rollback,
        nothing of Django's watching the statements.
        """
        conn = self._conn
        if (
            self._detached
            or self._nested
            or self._atomic is None
            or conn is None
            or conn.vendor != "postgresql"
            or conn.connection is None
            or conn.needs_rollback
            or conn.execute_wrappers
            or conn.queries_logged
            or conn.atomic_blocks != [self._atomic]
        ):
            return None
        raw = conn.connection
        return raw if is_psycopg3(raw) and not raw.autocommit else None

    @contextmanager
    def _cursor(self) -> Iterator[Any]:
        if self._alone is not None:
            with autocommit(self._alone), self._conn.cursor() as cursor:
                yield cursor
            return
        if not self._detached:
            conn = self._conn if self._conn is not None else connections[self.using]
            with conn.cursor() as cursor:
                yield cursor
            return
        with store_connection(self.using, always_side=True) as conn, conn.cursor() as cursor:
            yield cursor
