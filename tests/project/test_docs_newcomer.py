"""
The errors a newcomer meets first are one line saying what to do: a missing
optional extra names the ``pip install 'idemflow[…]'`` that fixes it, on every
import path of an optional dependency, and a key table that was never created
names ``idemflow migrate`` from the library as well as the CLI, on the real
SQLite, PostgreSQL and MariaDB.

A missing package is simulated in a fresh interpreter by ``sys.modules[name] =
None``, which makes its import raise ``ModuleNotFoundError`` exactly as an
absent install does.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from idemflow import (
    AsyncIdempotency,
    ConfigurationError,
    Idempotency,
    Intent,
    MissingTable,
    Response,
)
from idemflow._errors import MissingExtra
from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from tests.conftest import POSTGRES_URL, unreachable

#: (packages made absent, code that reaches them, the extra the hint must name)
PATHS = [
    (
        ["psycopg", "psycopg_pool"],
        "from idemflow.stores.postgres import PostgresStore\n"
        "PostgresStore('postgresql://u@127.0.0.1/db')",
        "postgres",
    ),
    (
        ["psycopg", "psycopg_pool"],
        "from idemflow.stores.postgres import AsyncPostgresStore\n"
        "AsyncPostgresStore('postgresql://u@127.0.0.1/db')",
        "postgres",
    ),
    (
        ["psycopg", "psycopg_pool"],
        "from idemflow.stores.urls import open_store\nopen_store('postgresql://u@127.0.0.1/db')",
        "postgres",
    ),
    (
        ["pymysql"],
        "from idemflow.stores.mysql import MySQLStore\nMySQLStore('mysql://root@127.0.0.1/db')",
        "mysql",
    ),
    (
        ["redis"],
        "from idemflow.stores.urls import open_store\nopen_store('redis://127.0.0.1:6379/0')",
        "redis",
    ),
    (["starlette"], "import idemflow.integrations.starlette", "starlette"),
    (["fastapi", "starlette"], "import idemflow.integrations.fastapi", "fastapi"),
    (["flask", "werkzeug"], "import idemflow.integrations.flask", "flask"),
    (["django"], "import idemflow.integrations.django", "django"),
    (
        ["django"],
        "from idemflow.integrations.django.middleware import IdempotencyMiddleware",
        "django",
    ),
    (["prometheus_client"], "import idemflow.metrics", "metrics"),
    (["aio_pika", "aiormq"], "import idemflow.consumers.rabbitmq", "rabbitmq"),
    (["nats"], "import idemflow.consumers.nats", "nats"),
    (["celery", "kombu"], "import idemflow.consumers.celery", "celery"),
    (["httpx"], "from idemflow.client import IdempotentTransport\nIdempotentTransport()", "client"),
    (["requests"], "from idemflow.client import IdempotentAdapter\nIdempotentAdapter()", "client"),
]

PROBE = """
import sys
for name in {absent!r}:
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    sys.modules[name] = None
try:
{code}
except ImportError as exc:
    print(type(exc).__name__)
    print(exc)
else:
    print("no error")
"""


@pytest.mark.parametrize(("absent", "code", "extra"), PATHS, ids=lambda v: str(v)[:40])
def test_a_missing_extra_is_one_line_naming_the_install(
    absent: list[str], code: str, extra: str
) -> None:
    indented = "\n".join("    " + line for line in code.splitlines())
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(absent=absent, code=indented)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    kind, message = done.stdout.splitlines()[:2]
    assert f"pip install 'idemflow[{extra}]'" in message, done.stdout
    if extra != "client":  # the client says it in its own ImportError (same one line)
        assert kind == "MissingExtra", done.stdout
        assert message.split(" needs ")[1].split(":")[0] in absent


def test_missing_extra_is_an_import_error_and_a_configuration_error() -> None:
    error = MissingExtra("idemflow.stores.redis", "redis", "redis")
    assert isinstance(error, ImportError)
    assert isinstance(error, ConfigurationError)
    assert error.name == "redis"
    assert str(error) == "idemflow.stores.redis needs redis: pip install 'idemflow[redis]'"


INTENT = Intent("alice", "k-1", "sha256:x", endpoint="POST /payments")


def ran(calls: list[int]) -> Response:
    calls.append(1)
    return Response(201)


def test_a_missing_sqlite_table_names_idemflow_migrate(tmp_path: Path) -> None:
    calls: list[int] = []
    idem = Idempotency(SQLiteStore(str(tmp_path / "never-migrated.db")))
    with pytest.raises(MissingTable, match=r"idemflow_keys does not exist .*idemflow migrate"):
        idem.run(INTENT, lambda attempt: ran(calls))
    assert calls == []


@pytest.mark.anyio
async def test_a_missing_table_names_idemflow_migrate_in_async_code(tmp_path: Path) -> None:
    calls: list[int] = []
    idem = AsyncIdempotency(AsyncSQLiteStore(str(tmp_path / "never-migrated.db")))

    async def handler(attempt: object) -> Response:
        return ran(calls)

    with pytest.raises(MissingTable, match="idemflow migrate"):
        await idem.run(INTENT, handler)
    assert calls == []


@pytest.mark.postgres
def test_a_missing_postgres_table_names_idemflow_migrate() -> None:
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    table = f"absent_{uuid.uuid4().hex[:12]}"
    store = PostgresStore(POSTGRES_URL, table=table)
    try:
        # A table of another name: the migrate it names creates that one.
        hint = f"{table} does not exist in the postgresql.* DATABASE_URL --table {table} "
        with pytest.raises(MissingTable, match=hint):
            Idempotency(store).run(INTENT, lambda attempt: Response(201))
    finally:
        store.close()


@pytest.mark.mysql
def test_a_missing_mysql_table_names_idemflow_migrate() -> None:
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs
    from tests.backends import MYSQL_URL

    try:
        pymysql.connect(**connect_kwargs(MYSQL_URL), connect_timeout=3).close()
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    table = f"absent_{uuid.uuid4().hex[:12]}"
    store = MySQLStore(MYSQL_URL, table=table)
    try:
        with pytest.raises(MissingTable, match=f"{table} does not exist"):
            Idempotency(store).run(INTENT, lambda attempt: Response(201))
    finally:
        store.close()


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("GET /payments", "idempotent already"),
        ("head /payments", "idempotent already"),
        ("/payments", "must be 'METHOD /route/"),
        ("POST payments", "must be 'METHOD /route/"),
    ],
)
def test_a_middleware_endpoint_that_could_never_be_protected_is_refused_at_start_up(
    endpoint: str, says: str
) -> None:
    """Starlette's IdempotencyMiddleware, like the WSGI one: at construction, not at a request."""
    from idemflow.integrations.starlette import IdempotencyMiddleware
    from idemflow.testing import AsyncMemoryStore

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never called")

    with pytest.raises(ConfigurationError, match=says):
        IdempotencyMiddleware(
            app, idempotency=AsyncIdempotency(AsyncMemoryStore()), endpoints=[endpoint]
        )
