"""
Crash tests: real ``idemflow demo`` processes that SIGKILL themselves at a chosen point.

The hook is the demo's test-only ``IDEMFLOW_DEMO_CRASH_AT`` variable
(``idemflow_demo.faults``); the servers, the databases and the kill are real.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.http.conftest import pg_url

__all__ = ["database_url", "pg_url"]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None for the demo's embedded SQLite, else a PostgreSQL URL on a fresh schema."""
    if request.param == "sqlite":
        yield None
    else:
        yield request.getfixturevalue("pg_url")
