"""
Crash tests: real ``idemflow demo`` processes that SIGKILL themselves at a chosen point.

The hook is the demo's test-only ``IDEMFLOW_DEMO_CRASH_AT`` variable
(``idemflow_demo.faults``); the servers, the databases and the kill are real.
"""

from __future__ import annotations

import pytest

from tests.http.conftest import pg_url

__all__ = ["backend", "pg_url"]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """The demo's embedded SQLite, or PostgreSQL on a fresh schema (``pg_schema``)."""
    return str(request.param)
