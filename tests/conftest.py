"""
Fixtures shared by the whole suite.

Service-backed tests talk to real servers. Their addresses come from
``IDEMFLOW_TEST_POSTGRES_URL`` (and friends); unset, the machine's loopback
defaults are tried. A server that cannot be reached skips its tests on a
developer's machine and **fails** them under ``CI=true``.
"""

from __future__ import annotations

import os
import uuid

import pytest

pytest_plugins = ["tests.backends", "tests.factories"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def unreachable(service: str, error: BaseException) -> None:
    """Skip locally, fail in CI: a missing backend must never turn CI green."""
    message = f"{service} is not reachable: {error}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture
def table_name() -> str:
    """A table of its own for each test, so tests never see each other's keys."""
    return f"idem_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
