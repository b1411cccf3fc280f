"""
The demo's MariaDB/MySQL and Redis databases for the tests, each one the test's own.

``mysql_url``: a fresh database on the shared MariaDB, dropped afterwards.
``redis_url``: the shared Redis (it runs without persistence, so the URL
acknowledges it with ``allow_volatile=1``) under a key prefix of the test's
own (the demo's ``key_prefix=``), whose keys are deleted afterwards.
:func:`mysql_database` and :func:`redis_prefix` are the same for fixtures of
a wider scope.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest

from tests.backends import MYSQL_URL, REDIS_URL, delete_keys
from tests.conftest import unreachable

__all__ = ["mysql_database", "mysql_url", "redis_prefix", "redis_url"]


@contextlib.contextmanager
def mysql_database() -> Iterator[str]:
    """A MariaDB/MySQL URL on a fresh database of its own, dropped afterwards."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import connect_kwargs

    kwargs = {**connect_kwargs(MYSQL_URL), "connect_timeout": 3}
    del kwargs["database"]
    database = f"demo_{uuid.uuid4().hex[:12]}"
    try:
        conn = pymysql.connect(**kwargs, autocommit=True)
    except pymysql.err.OperationalError as exc:
        unreachable("MySQL", exc)
    try:
        with conn.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {database}")
        try:
            yield f"{MYSQL_URL.rsplit('/', 1)[0]}/{database}"
        finally:
            with conn.cursor() as cursor:
                cursor.execute(f"DROP DATABASE {database}")
    finally:
        conn.close()


@contextlib.contextmanager
def redis_prefix() -> Iterator[str]:
    """The shared Redis, acknowledged volatile, under a key prefix of its own."""
    redis = pytest.importorskip("redis")
    prefix = f"demo_{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        unreachable("Redis", exc)
    separator = "&" if "?" in REDIS_URL else "?"
    try:
        yield f"{REDIS_URL}{separator}allow_volatile=1&key_prefix={prefix}"
    finally:
        delete_keys(client, prefix)
        client.close()


@pytest.fixture
def mysql_url() -> Iterator[str]:
    with mysql_database() as url:
        yield url


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_prefix() as url:
        yield url
