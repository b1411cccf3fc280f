"""Optional dependencies, imported in an ``optional(...)`` block where needed: a missing
one is one line naming the extra that installs it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._errors import MissingExtra

#: The extra that installs each optional top-level package.
EXTRAS = {
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "pymysql": "mysql",
    "redis": "redis",
    "sqlalchemy": "sqlalchemy",
    "starlette": "starlette",
    "fastapi": "fastapi",
    "django": "django",
    "rest_framework": "drf",
    "drf_spectacular": "drf",
    "flask": "flask",
    "werkzeug": "flask",
    "prometheus_client": "metrics",
    "opentelemetry": "tracing",
    "rich": "cli",
    "httpx": "client",
    "requests": "client",
    "aio_pika": "rabbitmq",
    "aiormq": "rabbitmq",
    "nats": "nats",
    "celery": "celery",
    "kombu": "celery",
}


@contextmanager
def optional(needed_by: str) -> Iterator[None]:
    """Imports in this block are optional dependencies of ``needed_by``: a missing package
    an extra installs is `MissingExtra`; any other import error goes through."""
    try:
        yield
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        extra = EXTRAS.get(package)
        if extra is None:
            raise
        raise MissingExtra(needed_by, package, extra) from exc
