"""
fastapi-idempotency 0.1.1 on PostgreSQL: its ``IdempotencyMiddleware`` with ``TortoiseStore``.

The middleware (a Starlette ``BaseHTTPMiddleware``) is added to the app with
``path_prefix="/things"`` so ``/plain/things`` is not checked; the store is its one persistent
backend, Tortoise ORM on asyncpg (Tortoise's default pool, 1 to 5 connections), registered with
``RegisterTortoise``. Its table name is fixed (``fastapi_idempotency_requests``), so runs are kept
apart by a PostgreSQL schema: the ``search_path`` of ``BENCH_URL``'s ``options`` if it has one,
else one named from ``BENCH_PREFIX``; the schema and table are created at startup. Defaults
otherwise: the caller scope is the client IP, the fingerprint is method, path, query and body
(same key, other body: 422 ``{"detail": ...}``), a replay answers the stored status, body and
headers (``content-length`` recomputed) plus ``Idempotent-Replayed: true``, and 5xx or
``Set-Cookie`` responses are not stored. A request without a key is not passed through: it is
deduplicated on its fingerprint for 10 s (``automatic_window``), so an identical keyless POST
within 10 s gets the replay.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi_idempotency import IdempotencyMiddleware
from fastapi_idempotency.stores.tortoise import TortoiseStore
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from tortoise import Tortoise
from tortoise.contrib.starlette import RegisterTortoise

from bench._thing import create, health

URL = os.environ.get("BENCH_URL", "postgresql://postgres@127.0.0.1:5432/test")


def tortoise_url(url: str) -> tuple[str, str]:
    """``url`` in Tortoise's form (libpq's ``options`` search_path as ``schema``); the schema."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    options = query.pop("options", [""])[-1]
    found = re.search(r"search_path=(\w+)", options)
    prefix = os.environ.get("BENCH_PREFIX", "bench_")
    schema = found.group(1) if found else re.sub(r"\W", "_", prefix).strip("_").lower()
    query["schema"] = [schema]
    return parts._replace(query=urllib.parse.urlencode(query, doseq=True)).geturl(), schema


def make_app() -> Starlette:
    db_url, schema = tortoise_url(URL)
    modules = {"models": ["fastapi_idempotency.stores.tortoise"]}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with RegisterTortoise(app, db_url=db_url, modules=modules):
            await Tortoise.get_connection("default").execute_script(
                f'CREATE SCHEMA IF NOT EXISTS "{schema}"'
            )
            await Tortoise.generate_schemas(safe=True)
            yield

    return Starlette(
        lifespan=lifespan,
        routes=[
            Route("/", health),
            Route("/things", create, methods=["POST"]),
            Route("/plain/things", create, methods=["POST"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=TortoiseStore(), path_prefix="/things")
        ],
    )


app = make_app()
