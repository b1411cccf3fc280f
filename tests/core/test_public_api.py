"""
The public API is flat, explicit and light: ``__all__`` says exactly what the
package exports, and importing it pulls in no framework and no database driver.

Both checks run ``import idemflow`` in a fresh interpreter, so nothing other
tests imported (``idemflow.testing``, drivers, frameworks) can hide a leak.
"""

from __future__ import annotations

import importlib
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
    "asyncmy",
    "prometheus_client",
    "opentelemetry",
    "uvicorn",
    "httpx",
    "rich",
    "django",
    "rest_framework",
    "drf_spectacular",
    "flask",
    "flask_sqlalchemy",
    "flask_login",
    "werkzeug",
    "gunicorn",
    "aio_pika",
    "aiormq",
    "nats",
    "celery",
    "kombu",
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


#: Where each store's public names have always been importable from (issue 10 moved
#: the code into one package per backend; these paths must keep working).
STORE_PATHS = [
    ("idemflow.stores", ["AsyncMemoryStore", "AsyncStore", "AsyncTransaction", "MemoryStore"]),
    ("idemflow.stores.postgres", ["AsyncPostgresStore", "PostgresStore", "connection_options"]),
    ("idemflow.stores.postgres", ["is_unavailable"]),
    ("idemflow.stores.mysql", ["MySQLStore", "connect_kwargs"]),
    ("idemflow.stores.mysql", ["is_unavailable", "closed_by_server"]),
    ("idemflow.stores.mysql", ["AsyncMySQLStore"]),
    ("idemflow.stores.sqlite", ["AsyncSQLiteStore", "SQLiteStore", "connect", "is_unavailable"]),
    ("idemflow.stores.redis", ["AsyncRedisStore", "RedisStore", "is_unavailable"]),
    ("idemflow.stores.memory", ["AsyncMemoryStore", "MemoryStore"]),
    ("idemflow.stores.protocol", ["MaintainableStore", "Statement", "Store", "Transaction"]),
    ("idemflow.stores.protocol", ["AsyncMaintainableStore", "AsyncStore", "AsyncTransaction"]),
    ("idemflow.stores.sql", ["AsyncSQLStore", "Dialect", "Statement", "SQLStore"]),
    ("idemflow.stores.sql", ["on_database_clock", "create_table", "insert_claim", "PURGEABLE_SQL"]),
    ("idemflow.stores.stats", ["StoreStats"]),
    ("idemflow.stores.urls", ["open_async_store", "open_store", "scheme_of", "sqlite_path"]),
    ("idemflow.transactions", ["AsyncPsycopgTransaction", "AsyncSQLAlchemyTransaction"]),
    ("idemflow.transactions", ["AsyncSQLite3Connection", "AsyncSQLite3Transaction"]),
    ("idemflow.transactions", ["PsycopgTransaction", "PyMySQLTransaction"]),
    ("idemflow.transactions", ["AsyncmyTransaction"]),
    ("idemflow.transactions", ["SQLAlchemyTransaction", "SQLite3Transaction"]),
    ("idemflow.tracing", ["TracingObserver", "traced", "traceparent"]),
    ("idemflow.edge", ["AsyncEdge", "Edge", "HTTPRequest", "pooled_transaction"]),
    # The conformance kit (issue 35).
    ("idemflow.audit", ["audit", "audit_async"]),
]


@pytest.mark.parametrize(("module", "names"), STORE_PATHS)
def test_every_public_store_path_still_imports(module: str, names: list[str]) -> None:
    """Each documented name resolves where it always did, and is in that module's ``__all__``."""
    imported = importlib.import_module(module)

    assert [name for name in names if not hasattr(imported, name)] == []
    assert [name for name in names if name not in imported.__all__] == []


#: Issue 32: names other public modules of the library (the CLI, ``transactions``,
#: another store) or a result's type still take from where they were, but no longer
#: promised: out of ``__all__``, off the reference page, importable without a warning.
UNLISTED = [
    ("idemflow.audit", ["CHECKS", "CheckResult", "Report", "plan"]),
    ("idemflow.client", ["ClientOutcome"]),
    ("idemflow.edge", ["KEY_HEADER"]),
    ("idemflow.logs", ["key_digest"]),
    ("idemflow.stores.mysql", ["error_code", "is_conflict", "is_contention", "rolled_back"]),
    ("idemflow.stores.mysql", ["UNAVAILABLE_CODES", "mysql_dialect", "mysql_statements"]),
    ("idemflow.stores.mysql", ["DEFAULT_LOCK_WAIT_TIMEOUT"]),
    ("idemflow.stores.postgres", ["SERVER_NOW_MS", "postgres_dialect"]),
    ("idemflow.stores.postgres", ["DEFAULT_CLAIM_LOCK_TIMEOUT_MS"]),
    ("idemflow.stores.protocol", ["CommitFailed", "NotFused", "StoreClock", "check_clock"]),
    ("idemflow.stores.redis", ["open_redis"]),
    ("idemflow.stores.sql", ["SQLStats", "missing_table_is_clear"]),
    ("idemflow.stores.sql.dialect", ["COLUMNS", "NEW_INTENT_SQL", "TAKE_OVER_SQL", "row_mapping"]),
    (
        "idemflow.stores.sql.dialect",
        ["claim_params", "complete_params", "record_from_values", "sweep_params"],
    ),
    ("idemflow.stores.sqlite", ["sqlite_dialect"]),
    ("idemflow.stores.stats", ["STUCK_STATES", "OldestClaim", "StatsSource"]),
    ("idemflow.stores.urls", ["DATABASE_URL_ENV", "OPENERS", "redact"]),
    ("idemflow.sweeper", ["DEFAULT_BATCH_SIZE", "Reconciler", "Stop", "SweepReport"]),
    ("idemflow.sweeper", ["AsyncStop", "BackgroundSweeper"]),
    ("idemflow.tracing", ["AsyncTracedIdempotency", "TracedIdempotency"]),
]


@pytest.mark.parametrize(("module", "names"), UNLISTED)
def test_an_unlisted_name_still_imports_and_is_not_exported(module: str, names: list[str]) -> None:
    """Not public any more, and not broken either: each resolves where it did."""
    imported = importlib.import_module(module)

    assert [name for name in names if not hasattr(imported, name)] == []
    assert [name for name in names if name in imported.__all__] == []


def test_the_memory_stores_share_one_table() -> None:
    """``AsyncMemoryStore(store)`` reads and writes the records of the store it was given."""
    from idemflow.stores.memory import AsyncMemoryStore, MemoryStore

    sync = MemoryStore()
    shared = AsyncMemoryStore(sync)

    assert shared.table is sync.table
    assert shared.records is sync.records


#: 0.1's names that 0.2 replaced, and where each one's replacement lives.
DEPRECATED = [
    ("idemflow.stores.protocol", "OperableStore", "idemflow.stores.protocol", "MaintainableStore"),
    ("idemflow.stores.protocol", "AsyncLendingStore", "idemflow.stores.protocol", "AsyncStore"),
    ("idemflow.stores.protocol", "UnavailabilityRule", "idemflow.stores.protocol", "Store"),
    (
        "idemflow.stores.protocol",
        "CommittingTransaction",
        "idemflow.stores.protocol",
        "Transaction",
    ),
    ("idemflow.stores.sql", "SQLStatement", "idemflow.stores.protocol", "Statement"),
    ("idemflow.stores.sql.dialect", "SQLStatement", "idemflow.stores.protocol", "Statement"),
    ("idemflow.stores.mysql", "PyMySQLTransaction", "idemflow.transactions", "PyMySQLTransaction"),
    ("idemflow.stores.mysql", "AsyncmyTransaction", "idemflow.transactions", "AsyncmyTransaction"),
    # Issue 32: internals that were public by accident, private since 0.2.
    ("idemflow.stores.redis", "EXPIRES", "idemflow.stores.redis._scripts", "EXPIRES"),
    (
        "idemflow.stores.redis",
        "record_from_hash",
        "idemflow.stores.redis._scripts",
        "record_from_hash",
    ),
    ("idemflow.stores.mysql", "upsert_claim", "idemflow.stores.mysql._statements", "upsert_claim"),
    ("idemflow.stores.mysql", "unpack_read", "idemflow.stores.mysql._statements", "unpack_read"),
    ("idemflow.stores.sql.dialect", "row_shape", "idemflow.stores.sql._rows", "row_shape"),
    ("idemflow.stores.sql.dialect", "RowShape", "idemflow.stores.sql._rows", "RowShape"),
    ("idemflow.stores.sql.dialect", "headers_json", "idemflow._model", "headers_json"),
    ("idemflow.client", "Operation", "idemflow.client._retry", "Operation"),
    ("idemflow.client", "KeyLedger", "idemflow.client._keys", "KeyLedger"),
    (
        "idemflow.integrations.django.operations",
        "key_table_ddl",
        "idemflow.integrations.django.operations",
        "_key_table_ddl",
    ),
    ("idemflow.integrations.wsgi", "Endpoint", "idemflow.integrations.wsgi", "_Endpoint"),
    ("idemflow.integrations.django", "DjangoStore", "idemflow.stores.django", "DjangoStore"),
    ("idemflow.integrations.django.store", "DjangoStore", "idemflow.stores.django", "DjangoStore"),
    (
        "idemflow.integrations.django.store",
        "DjangoTransaction",
        "idemflow.integrations.django",
        "DjangoTransaction",
    ),
    (
        "idemflow.integrations.django.transaction",
        "DjangoTransaction",
        "idemflow.integrations.django",
        "DjangoTransaction",
    ),
    ("idemflow.stores.memory", "MemoryTable", "idemflow.stores.memory._table", "MemoryTable"),
    ("idemflow.stores.stats", "stats_refused", "idemflow.stores.protocol", "_stats_refused"),
    ("idemflow.metrics", "RESOLUTIONS", "idemflow.metrics", "_RESOLUTIONS"),
    ("idemflow.tracing", "SPAN_NAME", "idemflow._spans", "SPAN_NAME"),
    ("idemflow.stores.sql", "is_missing_table", "idemflow.stores.sql._stats", "is_missing_table"),
    # Issue 32: the integrations' own plumbing, private since 0.2.
    (
        "idemflow.integrations.django",
        "IdemflowSettings",
        "idemflow.integrations.django.conf",
        "IdemflowSettings",
    ),
    (
        "idemflow.integrations.django",
        "idemflow_settings",
        "idemflow.integrations.django.conf",
        "idemflow_settings",
    ),
    (
        "idemflow.integrations.wsgi",
        "require_length",
        "idemflow.integrations.wsgi",
        "_require_length",
    ),
    (
        "idemflow.integrations.flask",
        "flask_login_user",
        "idemflow.integrations.flask",
        "_flask_login_user",
    ),
    ("idemflow", "AsyncHandler", "idemflow._async.driver", "AsyncHandler"),
    ("idemflow", "Handler", "idemflow._sync.driver", "Handler"),
    ("idemflow", "Clock", "idemflow._model", "Clock"),
    ("idemflow", "CountingObserver", "idemflow._events", "CountingObserver"),
    ("idemflow", "MissingExtra", "idemflow._errors", "MissingExtra"),
    ("idemflow", "canonical_json", "idemflow._identity", "canonical_json"),
    ("idemflow.client", "DEFAULT_METHODS", "idemflow.client._retry", "DEFAULT_METHODS"),
    ("idemflow.client", "KeyReusedLocally", "idemflow.client._keys", "KeyReusedLocally"),
    ("idemflow.logs", "DEFAULT_LEVELS", "idemflow.logs", "_DEFAULT_LEVELS"),
    ("idemflow.sweeper", "AsyncReconciler", "idemflow._async.sweeper", "AsyncReconciler"),
    ("idemflow.sweeper", "Resolution", "idemflow._reconcile", "Resolution"),
    ("idemflow.tracing", "linked_context", "idemflow._spans", "linked_context"),
    ("idemflow.stores.memory", "MemoryStats", "idemflow.stores.memory._table", "MemoryStats"),
    ("idemflow.stores.redis", "RedisStats", "idemflow.stores.redis._stats", "RedisStats"),
    (
        "idemflow.stores.mysql",
        "SERVER_NOW_MS",
        "idemflow.stores.mysql._statements",
        "SERVER_NOW_MS",
    ),
    (
        "idemflow.stores.mysql",
        "MySQLStatements",
        "idemflow.stores.mysql._statements",
        "MySQLStatements",
    ),
    ("idemflow.stores.sql", "StoreClock", "idemflow.stores.protocol", "StoreClock"),
    ("idemflow.stores.sql", "check_clock", "idemflow.stores.protocol", "check_clock"),
    ("idemflow.stores.sql.dialect", "StoreClock", "idemflow.stores.protocol", "StoreClock"),
    ("idemflow.stores.sql.dialect", "check_clock", "idemflow.stores.protocol", "check_clock"),
    *[
        ("idemflow.stores.sql", name, "idemflow.stores.sql.dialect", name)
        for name in (
            "COLUMNS",
            "NEW_INTENT_SQL",
            "PAST_RETENTION_SQL",
            "RETRY_SQL",
            "SWEEPABLE_SQL",
            "TAKE_OVER_SQL",
            "row_mapping",
            "take_over_claim",
        )
    ],
]


@pytest.mark.parametrize(("module", "old", "home", "new"), DEPRECATED)
def test_a_replaced_name_still_imports_with_a_deprecation_warning(
    module: str, old: str, home: str, new: str
) -> None:
    """For one minor version (docs/versioning.md): the replacement, and a warning naming it."""
    imported = importlib.import_module(module)

    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: use {home}\.{new}"):
        found = getattr(imported, old)

    assert found is getattr(importlib.import_module(home), new)
    assert old not in imported.__all__


#: Issue 32: at most 150 distinct public names. Each cut lowers this bound; it never rises
#: (issue 36's Consumer, AsyncConsumer and RedisStreams were paid for by edge's KEY_HEADER,
#: its RabbitMQ by edge's REQUEST_ID_HEADER: constants no page or example names; its
#: AsyncRedisStreams by the Django app's CreateKeyTable, which only the app's migration names;
#: Celery's exactly_once by postgres' DEFAULT_CLAIM_LOCK_TIMEOUT_MS, which no page names).
PUBLIC_NAMES_BOUND = 150
PUBLIC_NAMES_TARGET = 150


def public_names() -> set[str]:
    """The union of ``__all__`` over every module of ``idemflow`` with no private part."""
    import ast
    from pathlib import Path

    root = Path(idemflow.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(part.startswith("_") for part in parts):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                names |= set(ast.literal_eval(node.value))
    return names


def test_the_public_api_only_shrinks_towards_its_target() -> None:
    """A public name is a promise: the count goes down to ``PUBLIC_NAMES_TARGET``, never up."""
    count = len(public_names())

    assert count <= PUBLIC_NAMES_BOUND, (
        f"{count} public names: the bound is {PUBLIC_NAMES_BOUND} "
        f"(target {PUBLIC_NAMES_TARGET}); make a new name private, or drop another"
    )
