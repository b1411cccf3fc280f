"""
The backend contract: what a key store must do, and nothing more.

A store is a small :class:`typing.Protocol`, so third-party stores need not
import or inherit anything of ours. Each method is one atomic operation on one
record; the rules about *when* to call which live in ``idemflow._flow``.

``transaction`` arguments are the caller's own open transaction (see
:mod:`idemflow.transactions`): the completion is written there so the business
effect and the ``completed`` record commit together. Stores whose data cannot
share the caller's transaction set ``supports_transactions = False`` and the
driver refuses a transaction at configuration time; likewise
``supports_single_commit`` for a claim inside that transaction. The sweeper
and purge need a :class:`MaintainableStore`, the operator's questions an
:class:`ObservableStore`, the commands an :class:`OperableStore`. Callers rely
on these declarations, never on probing a store's attributes.

Three optional capabilities save round trips and pool checkouts, and a fourth
says what an error means. Each is a runtime-checkable protocol declaring only
what it adds; the driver checks a store's once, when the ``Idempotency`` is
made, and a transaction's once per class (:func:`declares`: an ``isinstance``
against a protocol costs microseconds, a request must not pay them), and uses
them where offered and the plain protocol everywhere else (a store or
transaction of your own needs none):

- a transaction with ``execute_and_commit`` (:class:`CommittingTransaction`)
  sends a fenced write together with the ``COMMIT`` that ends its phase (the
  psycopg adapters, and Django's and SQLAlchemy's on psycopg 3: one pipeline,
  one round trip, in which a write that matched no row raises on the server,
  so the ``COMMIT`` never runs); one that cannot at the moment (a savepoint
  open, another database) raises :class:`NotFused` before it sends anything;
- a :class:`LendingStore` (``claims_on_lent_connections`` true) has
  ``claim_on_lent(intent, lease_token, now, expires_at, lender)`` for
  two-commit mode: the claim commits on its own, on the connection the
  request's transaction then uses, when that transaction lends one from the
  store's own pool (:class:`LendingTransaction`);
- an :class:`UnavailabilityRule`, ``is_unavailable(exc)``, says whether an
  error means the database cannot serve the request (a pool that timed out,
  a connection gone): a store's is the rule its own operations answer
  ``StoreUnavailable`` by, and knows its driver's errors; a transaction's knows
  the errors of the library it adapts (SQLAlchemy's pool ``TimeoutError``, its
  invalidated connections), which wraps that driver's. The driver asks the
  transaction's rule, then the store's, of the ``BEGIN`` of the caller's
  transaction before the handler (with two commits, after the claim
  committed) and, with one commit, of the claim the transaction begins with:
  either way a 503 with the key given back at once, not a 500 (without a
  rule, the error propagates as is). An error the handler raises is its own,
  never judged.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from .._errors import ConfigurationError
from .._model import Claim, Intent, Record, Response, State
from .stats import StatsSource

__all__ = [
    "AsyncCommittingTransaction",
    "AsyncLendingStore",
    "AsyncLendingTransaction",
    "AsyncMaintainableStore",
    "AsyncOperableStore",
    "AsyncStore",
    "AsyncTransaction",
    "CommitFailed",
    "CommittingTransaction",
    "LendingStore",
    "LendingTransaction",
    "MaintainableStore",
    "NotFused",
    "ObservableStore",
    "OperableStore",
    "Quarantining",
    "Statement",
    "StatsSource",
    "Store",
    "StoreClock",
    "Transaction",
    "UnavailabilityRule",
    "check_clock",
    "declares",
]

#: Where the time every decision is taken on comes from: the store server's
#: clock (``"database"``, the default of the shared stores: hosts whose clocks
#: disagree cannot take a live claim or an unexpired record over) or the
#: ``now`` each call passes (``"caller"``: one-host stores, tests with a frozen clock).
StoreClock: TypeAlias = Literal["database", "caller"]


def check_clock(clock: str) -> StoreClock:
    """``clock`` as a :data:`StoreClock`, or :class:`~idemflow.ConfigurationError`."""
    if clock not in ("database", "caller"):
        msg = f"clock must be 'database' or 'caller', got {clock!r}"
        raise ConfigurationError(msg)
    return "database" if clock == "database" else "caller"


class Statement(Protocol):
    """One SQL statement in the two parameter styles the adapters need."""

    @property
    def named(self) -> str:
        """``:name`` placeholders (sqlite3, SQLAlchemy ``text()``)."""

    @property
    def pyformat(self) -> str:
        """``%(name)s`` placeholders (psycopg, PyMySQL)."""

    def bind(self, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Only the parameters this statement names (drivers reject extras), or None."""


class Transaction(Protocol):
    """The caller's transaction on the caller's connection (sync)."""

    @property
    def connection(self) -> Any:
        """What the handler uses for its own business writes."""

    def begin(self) -> None: ...
    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int: ...
    def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...


class AsyncTransaction(Protocol):
    """The caller's transaction on the caller's connection (async)."""

    @property
    def connection(self) -> Any:
        """What the handler uses for its own business writes."""

    async def begin(self) -> None: ...
    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int: ...
    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None: ...
    async def commit(self) -> None: ...
    async def rollback(self) -> None: ...


class CommitFailed(Exception):
    """Raised by ``execute_and_commit`` when the write went through but its COMMIT failed.

    (Or the ``BEGIN`` after it.) The ``COMMIT``'s own error is its ``__cause__``:
    the driver raises that one, as it would from a ``commit()`` of its own.
    """


class NotFused(Exception):
    """Raised by ``execute_and_commit`` before it sent anything: not together, this time.

    The transaction cannot send this write with its COMMIT now (Django's or
    SQLAlchemy's on another database than PostgreSQL, in a savepoint, …): the
    caller sends the write alone and commits after it, as for a transaction
    without ``execute_and_commit``.
    """


@runtime_checkable
class CommittingTransaction(Protocol):
    """Optional: a transaction that sends a fenced write and its COMMIT in one round trip.

    A capability: it declares only what such a :class:`Transaction` adds.
    """

    def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """Run the write; commit (then begin again, with ``begin``) only if it changed one row.

        Returns the rows the write changed. Anything but 1 commits nothing
        and leaves the transaction open, to be rolled back. Raises
        :class:`CommitFailed` when the write went through and the COMMIT did not,
        :class:`NotFused` (having sent nothing) when they cannot travel together.
        """


@runtime_checkable
class AsyncCommittingTransaction(Protocol):
    """:class:`CommittingTransaction` with coroutines."""

    async def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int: ...


@runtime_checkable
class LendingTransaction(Protocol):
    """Optional: a transaction that can lend its connection to the claim before it begins.

    A capability: it declares only what such a :class:`Transaction` adds.
    """

    def lend(self, sources: tuple[Any, ...]) -> Any:
        """Its connection, taken now if not yet taken, or None.

        ``sources`` are where the store's own connections come from (a pool's
        ``connection``, a store's checked checkout): a connection is lent only
        when this transaction takes its connections from one of them, so the
        claim runs on a connection the store would have used itself. Nothing is
        taken when it does not.
        """


@runtime_checkable
class AsyncLendingTransaction(Protocol):
    """:class:`LendingTransaction` with coroutines."""

    async def lend(self, sources: tuple[Any, ...]) -> Any: ...


@runtime_checkable
class UnavailabilityRule(Protocol):
    """Optional, for a store or a transaction (sync or async alike): what an error means."""

    def is_unavailable(self, exc: BaseException) -> bool:
        """Does ``exc`` mean the database cannot serve the request (fail closed: a 503)?

        A store's: its driver's errors (refused, lost, a pool of its own
        exhausted), the rule its operations answer ``StoreUnavailable`` by. A
        transaction's: its library's (SQLAlchemy's pool ``TimeoutError``, a
        connection it invalidated), for the ``BEGIN`` and the checkout of the
        caller's transaction. Never asked of an error the handler raised.
        """


@runtime_checkable
class Quarantining(Protocol):
    """Optional, for a store (sync or async alike) that refuses new claims for a while
    after it finds it may have lost some (Redis: a restart, a flush, a failover).

    The refusal must last the caller's stale threshold: until then a request that
    claimed before the loss may still be running, and its retry would run it again.
    Each driver (``Idempotency``, ``AsyncIdempotency``) tells the store its policy's
    threshold when it is made; the store keeps the longest it was told.
    """

    def cover_stale_threshold(self, seconds: float) -> None:
        """Refuse claims after a loss for at least ``seconds`` (never shortens it)."""


@functools.lru_cache(maxsize=128)
def declares(kind: type, capability: type) -> bool:
    """Does the class ``kind`` declare ``capability`` (one of the protocols above)?

    Asked of a class, once: ``isinstance`` against a runtime-checkable protocol
    costs microseconds (tens of them, on Python 3.11), more than a replay's own
    Python work, so the driver asks :func:`declares` of ``type(transaction)``,
    a dictionary look-up after the first time. What a class's instances gain
    through ``__getattr__`` is not declared: they run the plain protocol.
    """
    return issubclass(kind, capability)


class Store(Protocol):
    """A synchronous key store."""

    @property
    def supports_transactions(self) -> bool:
        """Can completions be written in the caller's transaction?"""

    @property
    def supports_single_commit(self) -> bool:
        """Can the claim itself join the caller's transaction (``single_commit=True``)?

        Only where a duplicate's wait on an uncommitted claim is bounded (a
        lock timeout answers 409): PostgreSQL, MySQL/MariaDB. Never where one
        writer queues every other (SQLite) or nothing is transactional (Redis).
        """

    def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> Claim:
        """Insert ``in_progress`` (or take over an expired/released record) atomically.

        Returns ``Claim(owned=True, …)`` when this call created or took over the
        record, else the record as it stands. Raises ``StoreUnavailable``.
        """

    def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> None:
        """Settle the record if it is still ours (``id``, lease token, ``in_progress``).

        ``expires_at`` is the end of its retention, counted from now: how long
        the outcome is replayed. Raises ``LeaseLost`` when no row matched.
        """

    def release(self, record: Record, now: float, transaction: Transaction | None = None) -> bool:
        """Give the key back if it is still ours. False when it was not.

        With ``transaction`` the write goes on the caller's connection (begun and
        committed by the driver), so a request never needs a second connection.
        """

    def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: Transaction | None = None,
    ) -> None:
        """Record progress (and renew the claim) if it is still ours; else ``LeaseLost``."""

    def get(self, principal: str, key: str) -> Record | None:
        """The record for ``(principal, key)``, for operators and tests."""


class AsyncStore(Protocol):
    """An asynchronous key store: :class:`Store` with coroutines."""

    @property
    def supports_transactions(self) -> bool: ...

    @property
    def supports_single_commit(self) -> bool: ...

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim: ...

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None: ...

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool: ...

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None: ...

    async def get(self, principal: str, key: str) -> Record | None: ...


@runtime_checkable
class LendingStore(Protocol):
    """Optional: a store that claims, with two commits, on the connection the request lends."""

    @property
    def claims_on_lent_connections(self) -> bool:
        """Can :meth:`claim_on_lent` claim on the request's connection now (a pool to lend from)?"""

    def claim_on_lent(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        lender: LendingTransaction,
    ) -> Claim:
        """:meth:`Store.claim`, committed on its own, on the connection ``lender`` will use."""


@runtime_checkable
class AsyncLendingStore(Protocol):
    """:class:`LendingStore` with coroutines."""

    @property
    def claims_on_lent_connections(self) -> bool: ...

    async def claim_on_lent(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        lender: AsyncLendingTransaction,
    ) -> Claim: ...


class MaintainableStore(Store, Protocol):
    """A store the sweeper and the purger can work on (every SQL store, the memory store)."""

    def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` records in ``from_state`` untouched since ``cutoff`` stale.

        One atomic statement per batch: a record is marked by one sweeper only.
        Marked records stay at least until ``keep_until`` (never purged unresolved).
        ``from_state=RELEASED`` marks only released records *with* a recovery
        point: an intent abandoned after progress that may include an external call.
        """

    def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        """Seconds until :meth:`sweep` with this ``cutoff`` would find a record to mark.

        ``oldest updated_at − cutoff`` over the records :meth:`sweep` considers
        (``from_state``; released ones only with a recovery point), measured as
        :meth:`sweep` measures, so on the database clock only the cutoff's
        distance from ``now`` counts. Negative: one is due already. ``math.inf``:
        none is in ``from_state``. ``None``: this store cannot tell cheaply, and
        the sweeper passes every interval instead of at the earliest deadline.
        Records written later cannot be due sooner than ``now − cutoff`` from now,
        which is what lets the sweeper sleep until the answer without being woken.
        """

    def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> bool:
        """Settle a record exactly as this sweeper marked it; False if it changed."""

    def release_stale(
        self,
        record: Record,
        now: float,
        transaction: Transaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        """Release a record exactly as this sweeper marked it; False if it changed.

        ``forget_progress`` clears its recovery point too (its local traces were undone).
        """

    def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` settled or released records past retention; how many.

        Never an ``in_progress`` or ``stale`` record, however old.
        """


class AsyncMaintainableStore(AsyncStore, Protocol):
    """:class:`MaintainableStore` with coroutines."""

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]: ...

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None: ...

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool: ...

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool: ...

    async def purge(self, now: float, limit: int) -> int: ...


class ObservableStore(Protocol):
    """A store that answers the operator's questions (``idemflow stats``, the stuck gauge)."""

    def stats(self) -> StatsSource:
        """The questions, asked synchronously; ConfigurationError where this store cannot answer.

        The sync SQL, memory and Redis stores answer; the async SQL and Redis
        stores refuse (open a sync store on the same database). Callers call
        it and never probe for it.
        """


class OperableStore(MaintainableStore, ObservableStore, Protocol):
    """What :func:`idemflow.stores.urls.open_store` opens and the operator commands run on."""

    def migrate(self) -> None:
        """Create the table (or nothing to create), idempotently."""

    def close(self) -> None:
        """Release the store's connections."""


class AsyncOperableStore(AsyncMaintainableStore, Protocol):
    """What :func:`idemflow.stores.urls.open_async_store` opens."""

    async def migrate(self) -> None: ...
    async def close(self) -> None: ...
