"""
Fixtures shared by the whole suite.

Service-backed tests talk to real servers. Their addresses come from
``IDEMFLOW_TEST_POSTGRES_URL`` (and friends); unset, the machine's loopback
defaults are tried. A server that cannot be reached skips its tests on a
developer's machine and **fails** them under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import pytest

pytest_plugins = ["tests.factories", "tests.backends"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def unreachable(service: str, error: BaseException) -> NoReturn:
    """Skip locally, fail in CI: a missing backend must never turn CI green."""
    message = f"{service} is not reachable: {error}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


T = TypeVar("T")


def selected_in_module(
    request: pytest.FixtureRequest, found: Callable[[pytest.Item], T | None]
) -> list[T]:
    """What ``found`` names in each test of the requesting module selected in this run
    (``-k``, ``-m``), once each, in run order: what a module fixture stages."""
    mine = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    return list(dict.fromkeys(f for item in mine if (f := found(item)) is not None))


@pytest.fixture
def table_name() -> str:
    """A table of its own for each test, so tests never see each other's keys."""
    return f"idem_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


#: Tests on the clusters the suite starts itself (one per session: per xdist worker).
_ON_A_CLUSTER = ("galera", "redis-cluster", "valkey-cluster", "test_redis_cluster.py")


#: Files of long tests that share no module fixture: each test is a work unit of its
#: own, so their restarts under load (10-50 s each, mostly waiting) run side by side
#: on several workers instead of one after another on one. Not the storms: each file
#: stays whole, so two storms at most run at once (four at once left keys unresolved
#: on a loaded machine).
_EACH_TEST_ALONE = (
    "tests/http/test_demo_pool_pressure.py",
    "tests/http/test_demo_convergence.py",
    "tests/http/test_demo_database_restart.py",
)


def _work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: a file (its module fixtures, e.g. the framework
    faults' staged servers, start once), every test on a self-started cluster (one
    Galera, one Redis and one Valkey cluster for the run, not one per worker), or one
    test of :data:`_EACH_TEST_ALONE`."""
    if any(name in nodeid for name in _ON_A_CLUSTER):
        return "clusters"
    path = nodeid.split("::", 1)[0]
    return nodeid if path in _EACH_TEST_ALONE else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker under ``--no-loadscope-reorder``, send the long work units first.

    xdist's own order (most tests first) puts the few-test, long files (storms,
    crash and fault tests) last, where one can run alone while the other worker
    idles. Here the work units holding a test marked ``slow`` come first, then
    the rest, each group most tests first as xdist would; scripts/test turns
    xdist's reordering off (``--no-loadscope-reorder``) so this order holds.
    """
    # A worker runs with --dist no; that xdist's order is off tells this order is wanted.
    if not hasattr(config, "workerinput") or config.getoption("loadscopereorder", True):
        return
    sizes: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        unit = _work_unit(item.nodeid)
        sizes[unit] = sizes.get(unit, 0) + 1
        if item.get_closest_marker("slow") is not None:
            slow.add(unit)

    def rank(item: pytest.Item) -> tuple[bool, int]:
        unit = _work_unit(item.nodeid)
        return unit not in slow, -sizes[unit]

    items.sort(key=rank)  # stable: units of one rank stay in the order collected


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``pytest -n N --dist loadfile`` (scripts/test) schedules by :func:`_work_unit`.

        (xdist's ``loadgroup`` marks cannot do it under pytest 9.2: they rename
        ``item._nodeid``, which pytest no longer reads.)
        """
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

        class ByWorkUnit(LoadScopeScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:
                return _work_unit(nodeid)

        return ByWorkUnit(config, log)
