"""
The doomed side of tests/guarantees/crash/test_phase_kills.py: what a spawned launcher
imports (little: no pytest, no hypothesis) and the children it forks run, until they
SIGKILL themselves.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from idemflow import Idempotency, Policy, Response
from idemflow._sync.edge import pooled_transaction
from idemflow.testing import FrozenClock
from tests.factories import ForwardingTransaction

POLICY = Policy(request_timeout=5)
PHASE = "charging"
START = 1_800_000_000.0  # the FrozenClock's start, in the children and the parent
FRESH = ("after_commit_phase", "after_call")
RESUMED = ("before_commit_claim", "after_commit_claim", "after_resumed_call")
CREATED = Response.json(201, {"id": "pay_1"})
POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")


def intent(key: str) -> Any:
    from idemflow import Intent

    return Intent("alice", key, "fp-1", endpoint="POST /payments")


@dataclass(frozen=True)
class Side:
    """How one database is reached: its store, its transaction adapter, plain SQL."""

    kind: str
    table: str

    def store(self, *, migrating: bool = False) -> Any:
        """A sync store on a pool of one connection, deciding on the caller's clock
        (``migrating``: its DDL may wait on a catalog lock, not the claims' 50 ms)."""
        if self.kind == "postgres":
            from idemflow.stores.postgres import DEFAULT_CLAIM_LOCK_TIMEOUT_MS, PostgresStore

            bound = 10_000 if migrating else DEFAULT_CLAIM_LOCK_TIMEOUT_MS
            return PostgresStore(
                POSTGRES_URL,
                table=self.table,
                max_size=1,
                clock="caller",
                claim_lock_timeout_ms=bound,
            )
        from idemflow.stores.mysql import MySQLStore

        return MySQLStore(MYSQL_URL, table=self.table, max_size=1, clock="caller")

    def adapter(self) -> Callable[[Any], Any]:
        from idemflow.transactions import PsycopgTransaction, PyMySQLTransaction

        return PsycopgTransaction if self.kind == "postgres" else PyMySQLTransaction

    @contextlib.contextmanager
    def connect(self) -> Iterator[Any]:
        """An autocommit connection of its own (the provider's, or the test's)."""
        if self.kind == "postgres":
            import psycopg

            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                yield conn
            return
        import pymysql

        from idemflow.stores.mysql import connect_kwargs

        with contextlib.closing(
            pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
        ) as conn:
            yield conn

    def execute(self, conn: Any, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        if self.kind == "postgres":
            cursor = conn.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def charge(self, key: str, downstream_key: str) -> None:
        """The provider charges: its own database write, committed at once."""
        with self.connect() as conn:
            self.execute(
                conn, f"INSERT INTO provider_{self.table} VALUES (%s, %s)", (key, downstream_key)
            )

    def charges(self, key: str | None = None, downstream_key: str | None = None) -> int:
        with self.connect() as conn:
            column, value = ("k", key) if downstream_key is None else ("dk", downstream_key)
            rows = self.execute(
                conn, f"SELECT count(*) FROM provider_{self.table} WHERE {column} = %s", (value,)
            )
        return int(rows[0][0])


def handler_for(side: Side, kill_at: str | None = None) -> Callable[[Any], Response]:
    """The payment: phase 1 a pending row, then the charge, then the row marked charged."""

    def handler(attempt: Any) -> Response:
        if attempt.recovery_point is None:
            side.execute(attempt.connection, f"INSERT INTO biz_{side.table} VALUES ('payment')")
            attempt.commit_phase(PHASE)
            if kill_at == "after_commit_phase":
                os.kill(os.getpid(), signal.SIGKILL)
        side.charge(attempt.record.key, attempt.downstream_key("charge"))
        if kill_at in ("after_call", "after_resumed_call"):
            os.kill(os.getpid(), signal.SIGKILL)
        side.execute(attempt.connection, f"INSERT INTO biz_{side.table} VALUES ('charged')")
        return CREATED

    return handler


class KilledAtCommit(ForwardingTransaction):
    """The request's transaction; the process dies just before, or just after, its first
    commit (in a resumed single-commit run, the commit of the take-over)."""

    def __init__(self, inner: Any, kill_at: str) -> None:
        self.inner, self._kill_at = inner, kill_at

    @property
    def connection(self) -> Any:
        return self.inner.connection

    def commit(self) -> None:
        if self._kill_at == "before_commit_claim":
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.commit()
        if self._kill_at == "after_commit_claim":
            os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _doomed(side: Side, key: str, kill_at: str) -> None:
    """In a forked child: one single-commit request that kills its own process."""
    store = side.store()
    idem = Idempotency(store, POLICY, clock=FrozenClock(START))
    with pooled_transaction(store.pool.connection, side.adapter()) as pooled:
        transaction = KilledAtCommit(pooled, kill_at)
        idem.run(
            intent(key), handler_for(side, kill_at), transaction=transaction, single_commit=True
        )


def launch(side: Side, kills: dict[str, str], results: Any) -> None:
    """The spawned launcher: a forked child per kill, each waited for; then their ends."""
    ends: dict[str, int] = {}
    for key, kill_at in kills.items():
        pid = os.fork()
        if pid == 0:  # the child: it must die by its own SIGKILL, never return
            try:
                _doomed(side, key, kill_at)
            finally:
                os._exit(70)
        _, status = os.waitpid(pid, 0)
        ends[key] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    results.put(ends)
