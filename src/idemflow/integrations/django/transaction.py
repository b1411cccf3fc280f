"""The view's ``transaction.atomic()`` as the driver's transaction, on Django's connections."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from ..._errors import ConfigurationError
from ...stores.django import autocommit, idle_psycopg3, is_psycopg3, store_connection
from ...stores.protocol import CommitFailed, NotFused, Statement, Transaction
from ...transactions import PsycopgTransaction

__all__ = ["DjangoTransaction"]


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
    """The view's ``transaction.atomic()`` on ``connections[using]``, as the driver needs it.

    Outside any atomic block, ``begin``/``commit``/``rollback`` are an outermost
    ``atomic`` (BEGIN, COMMIT and ``on_commit``, ROLLBACK). Inside one, a savepoint:
    the completion commits with the enclosing transaction, and after a rollback the
    release goes through an autocommit side connection (refused on SQLite, whose one
    writer is the enclosing transaction). A transaction marked for rollback is never
    reported committed. docs/frameworks/django.md, "Transactions, ``ATOMIC_REQUESTS``
    and what commits when".
    """

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
        atomic = transaction.atomic(using=self.using)
        atomic.__enter__()
        self._atomic = atomic

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        with self._cursor() as cursor:
            cursor.execute(statement.pyformat, statement.bind(params))
            return int(cursor.rowcount)

    def fetchone(self, statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        with self._cursor() as cursor:
            cursor.execute(statement.pyformat, statement.bind(params))
            row = cursor.fetchone()
            if row is None:
                return None
            return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}

    def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The fenced write and its COMMIT in one round trip, on PostgreSQL through psycopg 3.

        Sent as ``PsycopgTransaction`` sends them, on the psycopg connection under
        Django's; Django then ends its ``atomic`` block (nothing left to send,
        ``on_commit`` runs). Everywhere else (SQLite, MySQL, psycopg2, a savepoint, a
        transaction marked for rollback, an instrumented connection)
        `NotFused`, before anything is sent.
        """
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
