"""What a PyMySQL (or asyncmy) error means: taken, contended, or the server is not there (a 503),
and how long a statement that lost a conflict waits before it is sent again."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

from ..._errors import StoreUnavailable, driver_error

# "The server is not there": can't connect (2002, 2003), gone away / lost (2006, 2013), too
# many connections (1040), shutting down (1053), connection killed (1927 MariaDB, 4031
# MySQL 8), a Galera node outside the primary component (1047).
_UNREACHABLE = frozenset({1040, 1047, 1053, 1927, 2002, 2003, 2006, 2013, 4031})
#: Duplicate key, lock wait timeout, deadlock.
DUPLICATE, LOCK_WAIT_TIMEOUT, DEADLOCK = 1062, 1205, 1213
#: Error numbers that mean the server cannot take the statement now: a 503, not a 500.
UNAVAILABLE_CODES = _UNREACHABLE | {LOCK_WAIT_TIMEOUT}


def error_code(exc: BaseException) -> int | None:
    """The server's error number of a PyMySQL or asyncmy error (or one wrapped)."""
    original = driver_error(exc)
    args = getattr(original, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def is_unavailable(exc: BaseException) -> bool:
    """Cannot reach the server, or it is too busy to take the statement (or one wrapped)."""
    original = driver_error(exc)
    if isinstance(exc, PoolExhausted) or _is_driver_error(original, "InterfaceError"):
        return True
    return _is_driver_error(original, "OperationalError") and error_code(exc) in UNAVAILABLE_CODES


def _is_driver_error(exc: BaseException, name: str) -> bool:
    """Is ``exc`` PyMySQL's (or asyncmy's) error ``name``? By name, not identity: PyMySQL
    installed as MySQLdb (Django) runs its error module a second time, with classes of its own."""
    # PyMySQL's error module is any ``….err``; asyncmy's is ``asyncmy.errors``.
    modules = (c.__module__ for c in type(exc).__mro__ if c.__name__ == name)
    return any(module.endswith(".err") or module == "asyncmy.errors" for module in modules)


def is_conflict(exc: BaseException) -> bool:
    """A deadlock victim or (Galera) a certification failure: the transaction had no effect."""
    return error_code(exc) == DEADLOCK


def is_contention(exc: BaseException) -> bool:
    """A lock wait timeout or deadlock: another transaction holds this key's row."""
    return error_code(exc) in (LOCK_WAIT_TIMEOUT, DEADLOCK)


#: How often a statement that lost a conflict (so had no effect) is sent in all.
DEADLOCK_RETRIES = 5
#: Galera: how often a fenced write in the caller's transaction that found no row is judged
#: again (the claim's apply lag).
APPLY_RETRIES = 8
# Between attempts (seconds): on Galera the winner's write set may not be applied here yet.
_CONFLICT_BACKOFF = 0.002
_CONFLICT_BACKOFF_MAX = 0.05


def conflict_pause(attempt: int) -> float:
    """How long (seconds, random: full jitter) to wait before attempt ``attempt + 1``."""
    return random.uniform(0, min(_CONFLICT_BACKOFF * 2**attempt, _CONFLICT_BACKOFF_MAX))


def rolled_back() -> StoreUnavailable:
    """The 503 of a caller's transaction that a conflicting write rolled back."""
    return StoreUnavailable(
        "the transaction was rolled back by a conflicting write (a deadlock, or a Galera "
        "certification failure): nothing was recorded; retry with the same key"
    )


def kept_losing() -> StoreUnavailable:
    """The 503 of an autocommit statement still losing conflicts after every retry."""
    msg = "the key store kept losing write conflicts (deadlock or Galera certification)"
    return StoreUnavailable(msg)


@contextmanager
def rolled_back_is_503() -> Iterator[None]:
    """A conflict inside the caller's transaction rolled it all back: `rolled_back`."""
    try:
        yield
    except Exception as exc:
        if is_conflict(exc):
            raise rolled_back() from exc
        raise


class PoolExhausted(Exception):
    """Every connection of the pool stayed busy for the whole timeout."""
