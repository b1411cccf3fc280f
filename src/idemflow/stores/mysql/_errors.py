"""What a PyMySQL (or asyncmy) error means: taken, contended, or the server is not there (a 503)."""

from __future__ import annotations

# Client errors meaning "the server is not there": can't connect (2002,
# 2003), gone away / lost (2006, 2013), too many connections (1040), server
# shutting down (1053), connection killed (1927 MariaDB, 4031 MySQL 8), and a
# Galera node outside the primary component (1047 "WSREP has not yet prepared
# node for application use": partitioned from the quorum, or still joining).
_UNREACHABLE = frozenset({1040, 1047, 1053, 1927, 2002, 2003, 2006, 2013, 4031})
#: Duplicate key, lock wait timeout, deadlock.
DUPLICATE, LOCK_WAIT_TIMEOUT, DEADLOCK = 1062, 1205, 1213
#: Error numbers that mean the server cannot take the statement now: a 503, not a 500.
UNAVAILABLE_CODES = _UNREACHABLE | {LOCK_WAIT_TIMEOUT}


def error_code(exc: BaseException) -> int | None:
    """The server's error number of a PyMySQL or asyncmy error (or of one wrapped by SQLAlchemy)."""
    original = getattr(exc, "orig", None) or exc
    args = getattr(original, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def is_unavailable(exc: BaseException) -> bool:
    """Cannot reach the server, or it is too busy to take the statement: fail closed."""
    if isinstance(exc, PoolExhausted) or _is_driver_error(exc, "InterfaceError"):
        return True
    return _is_driver_error(exc, "OperationalError") and error_code(exc) in UNAVAILABLE_CODES


def _is_driver_error(exc: BaseException, name: str) -> bool:
    """Is ``exc`` PyMySQL's (or asyncmy's) error ``name``? By name, not identity: PyMySQL
    installed as MySQLdb (Django) runs its error module a second time, with classes of its own."""
    return any(c.__name__ == name and _is_driver_module(c.__module__) for c in type(exc).__mro__)


def _is_driver_module(module: str) -> bool:
    """PyMySQL's error module is any ``….err``; asyncmy's is ``asyncmy.errors``."""
    return module.endswith(".err") or module == "asyncmy.errors"


def is_conflict(exc: BaseException) -> bool:
    """A deadlock victim, or (Galera) a certification failure, which MariaDB reports alike.

    Either way the statement, and the transaction it ran in, had no effect.
    """
    return error_code(exc) == DEADLOCK


def is_contention(exc: BaseException) -> bool:
    """A lock wait timeout or deadlock: another transaction holds this key's row."""
    return error_code(exc) in (LOCK_WAIT_TIMEOUT, DEADLOCK)


class PoolExhausted(Exception):
    """Every connection of the pool stayed busy for the whole timeout."""
