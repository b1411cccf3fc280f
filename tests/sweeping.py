"""Ending a claim as the sweeper would: the only way, now, that a claim in flight is lost.

Retention never takes over an ``in_progress`` record; tests that need an owner
to lose its claim mid-flight mark it stale and release it, fenced, exactly as
the sweeper's statements do.
"""

from __future__ import annotations

from typing import Any

from idemflow import Record, State


def sweep_away(store: Any, now: float) -> list[Record]:
    """Mark every claim whose own deadline is before ``now`` stale, then release it (sync
    store)."""
    marked: list[Record] = store.sweep(State.IN_PROGRESS, now, now, now + 3600, 1000)
    for record in marked:
        assert store.release_stale(record, now)
    return marked


async def async_sweep_away(store: Any, now: float) -> list[Record]:
    """:func:`sweep_away` for an async store."""
    marked: list[Record] = await store.sweep(State.IN_PROGRESS, now, now, now + 3600, 1000)
    for record in marked:
        assert await store.release_stale(record, now)
    return marked
