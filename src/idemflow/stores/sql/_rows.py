"""What the SQL executor sends and reads (a sweeper's fence, a result's shape), and what its
async source and sync twin share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..._errors import ConfigurationError, StoreUnavailable
from ..._model import Record
from ..protocol import Statement
from ._stats import is_missing_table, missing_table
from .dialect import COLUMNS, Dialect, claim_busy, owner_params


def stale_params(record: Record, now: float, *, forget_progress: bool = False) -> dict[str, Any]:
    """Fence for a sweeper's write: the record exactly as this sweeper marked it."""
    return {
        **owner_params(record, now),
        "marked_at": int(record.updated_at * 1000),
        "forget_progress": int(forget_progress),
    }


@dataclass(frozen=True, slots=True)
class RowShape:
    """Where a statement's result puts the record: ``COLUMNS`` in order from ``start``, and
    the positions of ``clock_now`` and ``claimed`` (or -1); rows are read as tuples."""

    start: int
    clock_now: int = -1
    claimed: int = -1


def row_shape(names: Sequence[str]) -> RowShape | None:
    """The shape of a result with these column names, or None if COLUMNS are not in a run."""
    names = list(names)
    try:
        start = names.index(COLUMNS[0])
    except ValueError:
        return None
    if tuple(names[start : start + len(COLUMNS)]) != COLUMNS:
        return None
    clock = names.index("clock_now") if "clock_now" in names else -1
    claimed = names.index("claimed") if "claimed" in names else -1
    return RowShape(start, clock, claimed)


class Executor:
    """The SQL executor's rules that are no coroutine, for `AsyncSQLStore` and `SQLStore`."""

    dialect: Dialect
    _is_unavailable: Callable[[BaseException], bool]
    _is_lock_timeout: Callable[[BaseException], bool]
    _pyformat: bool
    _shapes: dict[str, RowShape]

    @property
    def supports_single_commit(self) -> bool:
        """Only where the dialect bounds a duplicate's wait on an uncommitted claim."""
        return bool(self.dialect.before_claim_in_transaction)

    def is_unavailable(self, exc: BaseException) -> bool:
        """Does ``exc``, a driver error, mean the database cannot serve us (fail closed)?"""
        return self._is_unavailable(exc)

    def _learn_shape(self, text: str, cursor: Any) -> RowShape:
        """Read once per statement (psycopg builds ``cursor.description`` afresh each time)."""
        shape = row_shape([column[0] for column in cursor.description])
        if shape is None:
            msg = f"{self.dialect.name}: a record statement must return COLUMNS in order: {text}"
            raise ConfigurationError(msg)
        self._shapes[text] = shape
        return shape

    def _claim_failure(self, exc: Exception) -> Exception:
        """A 409 for a bounded wait on another's uncommitted claim, else `_unavailable`."""
        return claim_busy() if self._is_lock_timeout(exc) else self._unavailable(exc)

    def _unavailable(self, exc: Exception) -> Exception:
        """What ``exc`` means: StoreUnavailable (fail closed), MissingTable, or itself."""
        if is_missing_table(exc):
            return missing_table(self.dialect.table, self.dialect.name)
        if not self._is_unavailable(exc):
            return exc
        return StoreUnavailable(f"{self.dialect.name} key store unavailable: {exc}".strip())

    def _text(self, statement: Statement) -> str:
        return statement.pyformat if self._pyformat else statement.named

    def _translate(self, meaning: Callable[[Exception], Exception] | None = None) -> _Translated:
        """Driver failures as ``meaning`` (`_unavailable` by default) says (a missing table:
        `MissingTable`)."""
        return _Translated(meaning or self._unavailable)


class _Translated:
    """`Executor._translate`'s context: a class, as every statement enters one (a
    ``@contextmanager`` costs each ~60 more bytecodes)."""

    __slots__ = ("_meaning",)

    def __init__(self, meaning: Callable[[Exception], Exception]) -> None:
        self._meaning = meaning

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, Exception):
            failure = self._meaning(exc)
            if failure is not exc:
                raise failure from exc
