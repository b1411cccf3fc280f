"""The key store on the app's own SQLAlchemy engine (FastAPI's ``dependency(engine)``,
Flask's ``db=``): on PostgreSQL through psycopg, claimed on the engine's own pool, every
wait of the store's bounded by the store wait of the request being served (guarantee 5):
the checkout (a free connection, a pre-ping, a reconnect) waited for that long apart, each
wait for the server by psycopg's own timeout; an ``OperationalError`` either way (503)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from ._errors import ConfigurationError
from ._model import RUN_STORE_WAIT, Policy
from ._process import PID
from .stores.protocol import AsyncStore, Store

__all__ = ["async_engine_store", "engine_store"]

#: Checkouts waited for apart at once, at most (more wait their turn, within their wait).
_CHECKOUT_THREADS = 32
#: Checkouts that ended after the store wait, until their connection is back in the pool.
_LATE: set[Any] = set()


def engine_store(engine: Any, table: str, policy: Policy) -> Store:
    """The key store in ``engine``'s database: on PostgreSQL (psycopg), on the engine's own
    pool (one pool for the app); elsewhere the store its URL names (SQLite: the file)."""
    from .stores.urls import open_store

    if not _on_psycopg(engine):
        return open_store(_plain_url(engine.url), table=table, policy=policy)
    from .stores.postgres import postgres_dialect
    from .stores.sql import SQLStore

    store_wait = policy.store_wait_seconds
    _refuse_a_longer_pool_wait(engine, store_wait)
    autocommit, unavailable = _autocommit(engine), _unavailable_rule()

    @contextlib.contextmanager
    def connect() -> Iterator[Any]:
        seconds = _wait(store_wait)
        # The checkout runs apart, waited for up to the store wait: a pre-ping, then
        # SQLAlchemy's reconnect, would wait for a frozen server (its connect_timeout).
        checkout = _CHECKOUTS.submit(autocommit.connect)
        failed = _waited(checkout, seconds)
        if failed is not None:
            raise failed
        connection = checkout.result()
        raw: Any = None
        try:
            raw = connection.connection.driver_connection
            with _bounded(raw, seconds):
                yield raw
        except BaseException as exc:
            if _spent(raw) or unavailable(exc):
                connection.invalidate()  # SQLAlchemy never saw it die: not back to the pool
            raise
        finally:
            connection.close()

    return SQLStore(postgres_dialect(table), connect, **_options(engine, unavailable))


def async_engine_store(engine: Any, table: str, policy: Policy | None) -> AsyncStore:
    """`engine_store` for an ``AsyncEngine``: PostgreSQL (psycopg) or a SQLite file."""
    dialect, url = engine.dialect, engine.url
    if dialect.name == "sqlite" and url.database not in (None, "", ":memory:"):
        from .stores.sqlite import AsyncSQLiteStore

        return AsyncSQLiteStore(url.database, table=table, policy=policy)
    if not _on_psycopg(engine):
        msg = (
            "dependency() keeps keys in the engine's database on PostgreSQL (psycopg) or a "
            f"SQLite file, not {dialect.name}+{dialect.driver}: pass an Idempotent with a "
            "store instead"
        )
        raise ConfigurationError(msg)
    from .stores.postgres import postgres_dialect
    from .stores.sql import AsyncSQLStore

    store_wait = (policy or Policy()).store_wait_seconds
    autocommit, unavailable = _autocommit(engine), _unavailable_rule()

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[Any]:
        seconds = _wait(store_wait)
        # Never cancelled: a pre-ping or a connect cancelled mid-wait would wait for the
        # server again (psycopg's cancel request).
        checkout = asyncio.ensure_future(autocommit.connect().start())
        try:
            connection = await asyncio.wait_for(asyncio.shield(checkout), seconds)
        except BaseException as exc:
            _LATE.add(checkout)
            checkout.add_done_callback(_give_back_late)
            if isinstance(exc, TimeoutError):
                raise _no_connection(seconds) from exc
            raise
        raw: Any = None
        try:
            raw = (await connection.get_raw_connection()).driver_connection
            with _bounded(raw, seconds):
                yield raw
        except BaseException as exc:
            if _spent(raw) or unavailable(exc):
                await connection.invalidate(exc if isinstance(exc, Exception) else None)
            raise
        finally:
            await connection.close()

    return AsyncSQLStore(postgres_dialect(table), connect, **_options(engine, unavailable))


def _on_psycopg(engine: Any) -> bool:
    return bool(engine.dialect.name == "postgresql" and engine.dialect.driver.startswith("psycopg"))


def _autocommit(engine: Any) -> Any:
    """The store's statements commit alone: on a connection of the engine's pool,
    autocommit while the store holds it (SQLAlchemy resets it on return)."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def _unavailable_rule() -> Any:
    from .stores.postgres import is_unavailable
    from .transactions import SQLAlchemyTransaction

    # A pool timeout is SQLAlchemy's; a refused or lost connection psycopg's, maybe wrapped.
    return lambda exc: is_unavailable(exc) or SQLAlchemyTransaction.is_unavailable(exc)


def _options(engine: Any, unavailable: Any) -> dict[str, Any]:
    from .stores.postgres import is_lock_timeout

    return {
        "paramstyle": "pyformat",
        "is_unavailable": unavailable,
        "is_lock_timeout": is_lock_timeout,
        "extra_params": True,
        # A session on this pool holding a connection before the claim gives it back
        # (SQLAlchemyTransaction.lend): the claim never takes a second one.
        "lend_sources": (engine.pool,),
    }


def _wait(store_wait: float) -> float:
    """The store wait, or the run's when shorter (a route's own policy)."""
    run = RUN_STORE_WAIT.get()
    return store_wait if run is None else min(store_wait, run)


@contextlib.contextmanager
def _bounded(raw: Any, seconds: float) -> Iterator[None]:
    """Each wait of ``raw`` (psycopg) for the server ends after ``seconds``: psycopg's own
    timeout (a frozen server never runs its ``statement_timeout``; psycopg documents no
    bound of its own on a query's wait). This checkout's only: the app's next waits as before.
    Not cancelled instead: psycopg answers a cancellation mid-statement by asking the server
    to cancel it and waiting up to 10 s more."""
    plain = raw.wait

    def wait(gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        return plain(gen, interval, seconds if timeout is None else timeout)  # sync or async

    raw.wait = wait
    try:
        yield
    finally:
        del raw.wait


def _spent(raw: Any) -> bool:
    """A connection never to give back to the app's pool: lost, or left mid-statement."""
    from psycopg.pq import TransactionStatus

    return bool(
        raw is None or raw.closed or raw.pgconn.transaction_status != TransactionStatus.IDLE
    )


def _no_connection(seconds: float) -> Exception:
    import psycopg

    msg = f"no connection from the engine's pool within the store wait ({seconds:g} s)"
    return psycopg.OperationalError(msg)


def _waited(checkout: Future[Any], seconds: float) -> BaseException | None:
    """The checkout's own error after waiting up to ``seconds``, or the store's; its
    connection, if it comes later, given back then."""
    from concurrent.futures import TimeoutError as Late

    try:
        return checkout.exception(seconds)
    except Late:
        if not checkout.cancel():  # under way: its connection goes back once it has one
            _LATE.add(checkout)
            checkout.add_done_callback(_give_back_late)
        return _no_connection(seconds)


class _Apart:
    """Calls run on daemon threads, reused while idle, ``size`` at most: a checkout held by
    a frozen server (until it resumes, or TCP gives up) never holds up the interpreter's
    exit, as a ``ThreadPoolExecutor``'s worker would. A forked child starts afresh (its
    parent's threads are not its own)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._start()

    def _start(self) -> None:
        self._pid = PID[0]
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]]
        self._calls = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._room = self._size

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        if self._pid != PID[0]:
            self._start()
        future: Future[Any] = Future()
        self._calls.put((future, call))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if self._room > 0:
                    self._room -= 1
                    threading.Thread(
                        target=self._serve,
                        args=(self._calls, self._idle),
                        name="idemflow-checkout",
                        daemon=True,
                    ).start()
        return future

    @staticmethod
    def _serve(calls: queue.SimpleQueue[Any], idle: threading.Semaphore) -> None:
        while True:
            future, call = calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 -- the caller's, through the future
                    future.set_exception(exc)
            idle.release()


_CHECKOUTS = _Apart(_CHECKOUT_THREADS)


def _give_back_late(checkout: Any) -> None:
    _LATE.discard(checkout)
    if checkout.cancelled() or checkout.exception() is not None:
        return
    closing = checkout.result().close()
    if asyncio.iscoroutine(closing):
        task = asyncio.ensure_future(closing)
        _LATE.add(task)
        task.add_done_callback(_LATE.discard)


def _refuse_a_longer_pool_wait(engine: Any, store_wait: float) -> None:
    """A checkout waits for a free connection as long as the engine's ``pool_timeout``, which
    must then fit in the policy's store wait (else a thread per request would wait)."""
    from sqlalchemy.pool import QueuePool

    if not isinstance(engine.pool, QueuePool):  # the other pools never wait for a connection
        return
    timeout = engine.pool.timeout()
    if timeout > store_wait:
        msg = (
            f"the engine's pool_timeout ({timeout:g} s) exceeds the key store's wait "
            f"({store_wait:g} s, half the request timeout, at most 5 s): a request would wait "
            "for a connection past its budget. Create the engine with "
            f"create_engine(..., pool_timeout={store_wait:g}) (Flask-SQLAlchemy: "
            f'SQLALCHEMY_ENGINE_OPTIONS = {{"pool_timeout": {store_wait:g}}}), or pass '
            "IDEMFLOW_STORE for a pool of idemflow's own"
        )
        raise ConfigurationError(msg)


def _plain_url(url: Any) -> str:
    """SQLAlchemy's URL as idemflow's stores name it (``postgresql+psycopg://`` → ``postgresql://``)."""
    rendered = str(url.render_as_string(hide_password=False))
    scheme, _, rest = rendered.partition("://")
    return f"{scheme.split('+', 1)[0]}://{rest}"
