"""A store from a ``DATABASE_URL`` (``sqlite:///path.db``, ``postgresql://…``, ``mysql://…``,
``redis://…``, ``redis+cluster://…``); further schemes register in ``OPENERS``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from .._errors import ConfigurationError

if TYPE_CHECKING:
    from .._model import Policy
    from .protocol import AsyncMaintainableStore, MaintainableStore

__all__ = ["open_async_store", "open_store", "scheme_of", "sqlite_path"]

#: Environment variable every command reads when no URL is given.
DATABASE_URL_ENV = "IDEMFLOW_DATABASE_URL"


def scheme_of(url: str) -> str:
    """The store family a URL names (``sqlite``, ``postgresql``, …); ConfigurationError if none."""
    scheme = urlsplit(url).scheme.lower().split("+", 1)[0]
    family = {"postgres": "postgresql", "mariadb": "mysql", "rediss": "redis"}.get(scheme, scheme)
    if family not in OPENERS:
        known = ", ".join(f"{name}://" for name in sorted(OPENERS))
        msg = f"unsupported database URL {redact(url)!r}: use one of {known}"
        raise ConfigurationError(msg)
    return family


def sqlite_path(url: str) -> str:
    """``sqlite:///data/keys.db`` → ``data/keys.db``; ``sqlite:////tmp/k.db`` → ``/tmp/k.db``."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        msg = f"sqlite URLs take a path, not a host: {url!r} (write sqlite:///path/to.db)"
        raise ConfigurationError(msg)
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        msg = f"sqlite URL has no file path: {url!r} (write sqlite:///path/to.db)"
        raise ConfigurationError(msg)
    return path


def _open_sqlite(url: str, table: str, asynchronous: bool, policy: Policy | None) -> Any:
    from .sqlite import AsyncSQLiteStore, SQLiteStore

    path = sqlite_path(url)
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        msg = f"directory {parent!r} for the SQLite file does not exist"
        raise ConfigurationError(msg)
    return (AsyncSQLiteStore if asynchronous else SQLiteStore)(path, table=table, policy=policy)


def _open_postgres(url: str, table: str, asynchronous: bool, policy: Policy | None) -> Any:
    from .postgres import AsyncPostgresStore, PostgresStore  # no driver: MissingExtra, later

    conninfo = url.replace("postgres://", "postgresql://", 1)
    store = AsyncPostgresStore if asynchronous else PostgresStore
    return store(conninfo, table=table, policy=policy)


def _open_mysql(url: str, table: str, asynchronous: bool, policy: Policy | None) -> Any:
    """PyMySQL for `open_store`, asyncmy for `open_async_store`."""
    from .mysql import AsyncMySQLStore, MySQLStore

    store = AsyncMySQLStore if asynchronous else MySQLStore
    return store(url.replace("mariadb://", "mysql://", 1), table=table, policy=policy)


def _open_redis(url: str, table: str, asynchronous: bool, policy: Policy | None) -> Any:
    """``redis://``, ``rediss://`` or ``redis+cluster://``; the table name is the key prefix."""
    from .redis import open_redis

    return open_redis(url, prefix=table, asynchronous=asynchronous, policy=policy)


#: scheme → opener(url, table, asynchronous, policy). Other store modules add theirs.
OPENERS: dict[str, Callable[[str, str, bool, Policy | None], Any]] = {
    "sqlite": _open_sqlite,
    "postgresql": _open_postgres,
    "mysql": _open_mysql,
    "redis": _open_redis,
}


def open_store(
    url: str, *, table: str = "idemflow_keys", policy: Policy | None = None
) -> MaintainableStore:
    """A synchronous store for ``url``, its waits bounded by your ``policy``'s."""
    return cast("MaintainableStore", OPENERS[scheme_of(url)](url, table, False, policy))


def open_async_store(
    url: str, *, table: str = "idemflow_keys", policy: Policy | None = None
) -> AsyncMaintainableStore:
    """An asyncio store for ``url``, its waits bounded as `open_store`'s."""
    return cast("AsyncMaintainableStore", OPENERS[scheme_of(url)](url, table, True, policy))


def redact(url: str) -> str:
    """Never print a password."""
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url
