"""``mysql://`` URLs, as ``pymysql.connect`` arguments."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..._errors import ConfigurationError

_FOUND_ROWS = 2  # pymysql.constants.CLIENT.FOUND_ROWS


def connect_kwargs(url: str) -> dict[str, Any]:
    """``mysql://user:password@host:3306/db?found_rows=1`` → ``pymysql.connect`` arguments."""
    parts = urlsplit(url)
    database = unquote(parts.path.lstrip("/"))
    if not parts.hostname or not database:
        msg = f"MySQL URLs name a host and a database: mysql://user@host:3306/db, not {url!r}"
        raise ConfigurationError(msg)
    kwargs: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": database,
    }
    options = dict(parse_qsl(parts.query))
    if options.get("found_rows", "").lower() in ("1", "true", "yes"):
        kwargs["client_flag"] = _FOUND_ROWS
    return kwargs
