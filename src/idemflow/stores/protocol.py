"""The backend contract: what a key store and a caller's transaction must do.

Each method is one atomic operation on one record. Optional capabilities are methods
with a default, which callers call and never probe: a store or transaction of your own
subclasses its protocol to inherit them (``docs/architecture.md``, "Adding a store").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from .._deprecation import moved
from .._errors import ConfigurationError
from .._model import DEFAULT_STALE_SECONDS, Claim, Intent, Record, Response, State
from .stats import StatsSource

__all__ = [
    "AsyncMaintainableStore",
    "AsyncStore",
    "AsyncTransaction",
    "MaintainableStore",
    "Statement",
    "Store",
    "Transaction",
]

#: Where every decision's time comes from: the store server's clock (``"database"``, the
#: shared stores' default) or the ``now`` each call passes (``"caller"``: frozen-clock tests).
StoreClock: TypeAlias = Literal["database", "caller"]


def check_clock(clock: str) -> StoreClock:
    """``clock`` as a `StoreClock`, or [`ConfigurationError`][idemflow.ConfigurationError]."""
    if clock not in ("database", "caller"):
        msg = f"clock must be 'database' or 'caller', got {clock!r}"
        raise ConfigurationError(msg)
    return "database" if clock == "database" else "caller"


_NAMED = re.compile(r"(?<![:\w]):([a-z_]+)")


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement, written with ``:name`` placeholders and also rendered as ``%(name)s``.

    ``named`` suits sqlite3 and SQLAlchemy's ``text()``, ``pyformat`` psycopg and PyMySQL.
    """

    named: str
    pyformat: str = field(init=False)
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if "%" in self.named:
            msg = "statements must not contain '%': it breaks pyformat drivers"
            raise ValueError(msg)
        object.__setattr__(self, "pyformat", _NAMED.sub(r"%(\1)s", self.named))
        object.__setattr__(self, "names", frozenset(_NAMED.findall(self.named)))

    def bind(self, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """Only the parameters this statement names (drivers reject extras), or None."""
        if not self.names:
            return None
        return {name: params[name] for name in self.names}


class CommitFailed(Exception):
    """Raised by ``execute_and_commit`` when the write went through but its COMMIT (or the
    ``BEGIN`` after it) failed; that error is its ``__cause__``."""


class NotFused(Exception):
    """Raised by ``execute_and_commit`` before it sent anything: send the write, then commit."""


def _judges_nothing(exc: BaseException) -> bool:
    """A transaction's default rule: none of its errors means the database is unavailable."""
    return False


class Transaction(Protocol):
    """The caller's transaction on the caller's connection (sync): five statements, and
    three capabilities with defaults (`execute_and_commit`, `lend`, `is_unavailable`)."""

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

    def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The write and, if it changed one row, its COMMIT (then BEGIN, with ``begin``) in one
        round trip; the rows it changed. `CommitFailed`: the COMMIT failed; `NotFused` (by
        default): nothing sent, they cannot travel together."""
        raise NotFused

    def lend(self, sources: tuple[Any, ...]) -> Any:
        """Its connection, taken now, if it comes from one of ``sources`` (where the store's
        own connections come from); else None, the default."""
        return None

    def is_unavailable(self, exc: BaseException) -> bool:
        """Does ``exc`` (of this library, from the ``BEGIN`` or a checkout) mean the database
        cannot serve? Best static: a pooled transaction asks its class, before a checkout."""
        return False

    if not TYPE_CHECKING:
        is_unavailable = staticmethod(_judges_nothing)


class AsyncTransaction(Protocol):
    """[`Transaction`][idemflow.stores.protocol.Transaction] with coroutines."""

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

    async def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        raise NotFused

    async def lend(self, sources: tuple[Any, ...]) -> Any:
        return None

    def is_unavailable(self, exc: BaseException) -> bool:
        return False

    if not TYPE_CHECKING:
        is_unavailable = staticmethod(_judges_nothing)


class Store(Protocol):
    """A synchronous key store. Capabilities with defaults: `claim_on_lent`, `is_unavailable`,
    `cover_stale_threshold`, `cover_store_wait`, `stats`, `renew`, `migrate` and `close`."""

    @property
    def supports_transactions(self) -> bool:
        """Can completions be written in the caller's transaction?"""

    @property
    def supports_single_commit(self) -> bool:
        """Can the claim itself join the caller's transaction (``single_commit=True``)? Only
        where a duplicate's wait on an uncommitted claim is bounded (PostgreSQL, MySQL)."""

    def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        """Insert ``in_progress`` (or take over an expired/released record) atomically:
        ``Claim(owned=True, …)`` if this call did, else the record as it stands. The record
        keeps ``stale_after``, its own threshold: each owner write that dates it sets its
        ``stale_at`` that far on, on the store's clock. Raises ``StoreUnavailable``."""

    def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> None:
        """Settle the record if still ours (``id``, lease token, ``in_progress``), replayed
        until ``expires_at``; else ``LeaseLost``."""

    def release(self, record: Record, now: float, transaction: Transaction | None = None) -> bool:
        """Give the key back if it is still ours (on the caller's connection, with
        ``transaction``). False when it was not."""

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

    #: Whether `renew` keeps a claim alive (a consumer refuses a store that cannot).
    renews_claims: bool = False

    def renew(self, record: Record, now: float) -> None:
        """Date the claim ``now`` if still ours (fenced as `complete`), else ``LeaseLost``: a
        lease keeper's, while a long handler runs. By default `ConfigurationError`."""
        raise _renew_refused(self)

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
        """`claim`, committed on its own, on the connection ``lender`` lends
        (`Transaction.lend`); by default on the store's connection, as `claim`."""
        return self.claim(intent, lease_token, now, expires_at, stale_after=stale_after)

    def is_unavailable(self, exc: BaseException) -> bool:
        """Does ``exc`` mean the database cannot serve the request (fail closed: a 503)? Also
        asked of the ``BEGIN`` of the caller's transaction on the same database."""
        return False

    def cover_stale_threshold(self, seconds: float) -> None:
        """After a possible loss of claims (Redis), refuse new claims for at least ``seconds``
        (each driver tells its policy's stale threshold; the store keeps the longest)."""
        return

    def cover_store_wait(self, seconds: float) -> None:
        """Bound every wait of the store's own (checkout, connect, each reply) by ``seconds``
        (each driver tells its policy's ``store_wait_seconds``; the store keeps the shortest)."""
        return

    def stats(self) -> StatsSource:
        """The operator's questions (``idemflow stats``, the stuck gauge), asked synchronously;
        [`ConfigurationError`][idemflow.ConfigurationError] where this store cannot answer them."""
        raise _stats_refused(self)

    def migrate(self) -> None:
        """Create the table (or nothing to create), idempotently."""
        return

    def close(self) -> None:
        """Release the store's connections."""
        return


class AsyncStore(Protocol):
    """An asynchronous key store: [`Store`][idemflow.stores.protocol.Store] with coroutines."""

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
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
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

    renews_claims: bool = False  # `Store.renews_claims`

    async def renew(self, record: Record, now: float) -> None:
        raise _renew_refused(self)

    async def claim_on_lent(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        lender: AsyncTransaction,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        return await self.claim(intent, lease_token, now, expires_at, stale_after=stale_after)

    def is_unavailable(self, exc: BaseException) -> bool:
        return False

    def cover_stale_threshold(self, seconds: float) -> None:
        return

    def cover_store_wait(self, seconds: float) -> None:
        return

    def stats(self) -> StatsSource:
        """`Store.stats`: refused by every async store (open a sync one on the same data)."""
        raise _stats_refused(self)

    async def migrate(self) -> None:
        return

    async def close(self) -> None:
        return


class MaintainableStore(Store, Protocol):
    """A store the sweeper and the purger can work on (every SQL store, Redis, memory)."""

    def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark stale, in one atomic statement, up to ``limit`` records in ``from_state``
        whose ``stale_at`` is before ``cutoff``, earliest first, kept until ``keep_until`` at
        least (``RELEASED``: only those with a recovery point); ``docs/crash-safety.md``."""

    def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        """The earliest ``stale_at`` minus ``cutoff`` (negative: due), ``math.inf`` if none
        is in ``from_state``, None if this store cannot tell cheaply."""

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
        ``forget_progress`` clears its recovery point too."""

    def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` settled or released records past retention (never an
        ``in_progress`` or ``stale`` one); how many."""


class AsyncMaintainableStore(AsyncStore, Protocol):
    """[`MaintainableStore`][idemflow.stores.protocol.MaintainableStore] with coroutines."""

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


def _renew_refused(store: object) -> ConfigurationError:
    msg = f"{type(store).__name__} cannot renew a claim: a lease keeper needs another store"
    return ConfigurationError(msg)


def _stats_refused(store: object) -> ConfigurationError:
    msg = (
        f"{type(store).__name__} cannot answer stats queries: open a sync store on the "
        "same database (a pool of one or two connections is plenty)"
    )
    return ConfigurationError(msg)


#: Names of 0.1 the six protocols replace: their methods are part of these now, with defaults.
__getattr__ = moved(
    __name__,
    {
        old: f"idemflow.stores.protocol:{new}"
        for old, new in {
            "CommittingTransaction": "Transaction",
            "AsyncCommittingTransaction": "AsyncTransaction",
            "LendingTransaction": "Transaction",
            "AsyncLendingTransaction": "AsyncTransaction",
            "LendingStore": "Store",
            "AsyncLendingStore": "AsyncStore",
            "UnavailabilityRule": "Store",
            "Quarantining": "Store",
            "ObservableStore": "Store",
            "OperableStore": "MaintainableStore",
            "AsyncOperableStore": "AsyncMaintainableStore",
        }.items()
    }
    | {"declares": "builtins:issubclass"},
)
