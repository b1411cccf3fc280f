"""What the SQL executor sends and reads: a sweeper's fence, a result's shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._model import Record
from .dialect import COLUMNS, owner_params


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
