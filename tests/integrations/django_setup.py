"""
Django, configured once per test process, on the real servers the suite uses.

Four aliases: ``default`` (a SQLite file in WAL mode), ``postgres``, ``mysql``
(MariaDB through PyMySQL, installed as MySQLdb since Django's backend speaks
mysqlclient's interface) and ``postgres-pool`` (PostgreSQL through Django's
psycopg pool of one connection, whose wait ends after half a second). Tables are
per test, as elsewhere.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")

import django
from django.conf import settings

from idemflow.stores.mysql import connect_kwargs
from tests.backends import MYSQL_URL
from tests.conftest import POSTGRES_URL, unreachable

ALIASES = ("default", "postgres", "mysql", "postgres-pool")
#: The ``postgres-pool`` alias's pool: one connection, a checkout waits this long at most.
POOL_TIMEOUT = 0.5
VENDOR_ALIAS = {"sqlite": "default", "postgres": "postgres", "mysql": "mysql"}
_DIRECTORY = tempfile.mkdtemp(prefix="idemflow-django-")


def _postgres() -> dict[str, Any]:
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(POSTGRES_URL)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": info.get("dbname", "test"),
        "USER": info.get("user", "postgres"),
        "PASSWORD": info.get("password", ""),
        "HOST": info.get("host", "127.0.0.1"),
        "PORT": str(info.get("port", "5432")),
        "OPTIONS": {"connect_timeout": 3},
    }


def _mysql() -> dict[str, Any]:
    import pymysql

    pymysql.install_as_MySQLdb()
    # Django imports MySQLdb.constants, MySQLdb.converters, … : without aliases
    # Python would run PyMySQL's submodules a second time under those names and
    # rebind pymysql.err to the copy, so the errors PyMySQL raises would no
    # longer be instances of pymysql.err.* (tests elsewhere catch those).
    for name, module in list(sys.modules.items()):
        if name.startswith("pymysql."):
            sys.modules.setdefault("MySQLdb" + name[len("pymysql") :], module)
    kwargs = connect_kwargs(MYSQL_URL)
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": kwargs["database"],
        "USER": kwargs["user"],
        "PASSWORD": kwargs["password"],
        "HOST": kwargs["host"],
        "PORT": str(kwargs["port"]),
        "OPTIONS": {"charset": "utf8mb4", "connect_timeout": 3},
    }


def databases() -> dict[str, dict[str, Any]]:
    sqlite = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(Path(_DIRECTORY) / "app.db"),
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL", "timeout": 10},
    }
    pool = {"min_size": 0, "max_size": 1, "timeout": POOL_TIMEOUT}
    pooled = {**_postgres(), "OPTIONS": {**_postgres()["OPTIONS"], "pool": pool}}
    return {"default": sqlite, "postgres": _postgres(), "mysql": _mysql(), "postgres-pool": pooled}


def configure() -> None:
    if settings.configured:
        return
    settings.configure(
        DEBUG=False,
        DATABASES=databases(),
        INSTALLED_APPS=["idemflow.integrations.django"],
        USE_TZ=True,
        IDEMFLOW={},
    )
    django.setup()


configure()


def require(alias: str) -> None:
    """Skip (fail in CI) when the alias's server cannot be reached."""
    from django.db import connections
    from django.db.utils import OperationalError

    try:
        connections[alias].ensure_connection()
    except OperationalError as exc:
        unreachable(alias, exc)


@contextlib.contextmanager
def own_connection(alias: str) -> Iterator[Any]:
    """This thread's ``connections[alias]`` is a fresh connection until the block ends.

    A request thread has its own connection; tests that play several requests
    in one thread give each its own, as Django would.
    """
    from django.db import connections

    previous = connections[alias]
    fresh = connections.create_connection(alias)
    connections[alias] = fresh
    try:
        yield fresh
    finally:
        connections[alias] = previous
        fresh.close()


def execute(alias: str, sql: str, params: Any = None) -> list[Any]:
    """Run one statement in autocommit on the thread's connection; its rows, if any."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall()) if cursor.description else []
