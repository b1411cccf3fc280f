"""
The public API is flat, explicit and light: ``__all__`` says exactly what the
package exports, and importing it pulls in no framework and no database driver.

Both checks run ``import idemflow`` in a fresh interpreter, so nothing other
tests imported (``idemflow.testing``, drivers, frameworks) can hide a leak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

import idemflow

#: Optional dependencies: only the modules that need them may import them.
HEAVY = (
    "psycopg",
    "psycopg_pool",
    "sqlalchemy",
    "starlette",
    "fastapi",
    "redis",
    "pymysql",
    "prometheus_client",
    "opentelemetry",
    "uvicorn",
    "httpx",
    "rich",
    "django",
    "rest_framework",
    "flask",
    "flask_sqlalchemy",
    "flask_login",
    "werkzeug",
    "gunicorn",
)

PROBE = """
import json, sys, types
import idemflow
public = sorted(
    name
    for name, value in vars(idemflow).items()
    if not name.startswith("_") and not isinstance(value, types.ModuleType)
)
print(json.dumps({"public": public, "all": idemflow.__all__, "modules": sorted(sys.modules)}))
"""


@pytest.fixture(scope="module")
def fresh() -> dict[str, list[str]]:
    """What a fresh interpreter sees after ``import idemflow`` and nothing else."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


def test_all_is_sorted() -> None:
    """``__all__`` is kept in sorted order, so a diff shows exactly what was added."""
    assert idemflow.__all__ == sorted(idemflow.__all__)
    assert len(set(idemflow.__all__)) == len(idemflow.__all__)


def test_all_equals_the_public_names(fresh: dict[str, list[str]]) -> None:
    """Every public name is exported and every export exists: no helper leaks in."""
    assert fresh["all"] == sorted(fresh["public"])


def test_every_export_resolves() -> None:
    """``from idemflow import *`` cannot fail on a stale name."""
    missing = [name for name in idemflow.__all__ if not hasattr(idemflow, name)]

    assert missing == []


def test_version_is_served_lazily_and_unknown_names_raise() -> None:
    """``__version__`` comes from the installed metadata; typos are AttributeErrors."""
    assert idemflow.__version__ == metadata.version("idemflow")
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = idemflow.no_such_name


@pytest.mark.parametrize("package", HEAVY)
def test_import_pulls_in_no_framework_or_driver(fresh: dict[str, list[str]], package: str) -> None:
    """``import idemflow`` costs no optional dependency: each is imported where it is used."""
    loaded = [m for m in fresh["modules"] if m == package or m.startswith(f"{package}.")]

    assert loaded == []
