"""Which of the demo's databases a URL names (the one place that knows them all)."""

from __future__ import annotations

from pathlib import Path

from idemflow import ConfigurationError

from .db import Database, PostgresDatabase, SQLiteDatabase
from .db_mysql import MySQLDatabase
from .db_redis import RedisDatabase

__all__ = ["open_database"]


def open_database(
    url: str | None, sqlite_path: Path, *, pool_size: int = 8, claim_commit: str = "own"
) -> Database:
    """The database a URL names; the SQLite file at ``sqlite_path`` when there is none.

    ``postgresql://`` and ``mysql://`` (or ``mariadb://``) hold keys and
    payments; ``redis://`` holds the keys, and the payments go to the SQLite
    file at ``sqlite_path``.
    """
    from idemflow.stores.urls import scheme_of
    from idemflow.stores.urls import sqlite_path as path_of

    scheme = "sqlite" if url is None else scheme_of(url)
    if claim_commit != "own" and scheme != "postgresql":
        # SQLite has one writer: a claim left uncommitted in the endpoint's
        # transaction would hold every other request's claim behind it,
        # unbounded, instead of answering 409. Redis has no transaction to
        # join; the demo runs MySQL in two-commit mode.
        msg = (
            "--claim-commit single needs PostgreSQL: SQLite commits each claim on its own"
            if scheme == "sqlite"
            else f"--claim-commit single needs PostgreSQL: the demo commits each claim on its "
            f"own on {scheme}"
        )
        raise ConfigurationError(msg)
    if url is None:
        return SQLiteDatabase(sqlite_path, pool_size=pool_size)
    if scheme == "postgresql":
        return PostgresDatabase(url, pool_size=pool_size, claim_commit=claim_commit)
    if scheme == "sqlite":
        return SQLiteDatabase(Path(path_of(url)), pool_size=pool_size)
    if scheme == "mysql":
        return MySQLDatabase(url, pool_size=pool_size)
    if scheme == "redis":
        return RedisDatabase(url, sqlite_path, pool_size=pool_size)
    msg = f"the demo runs on SQLite, PostgreSQL, MySQL/MariaDB or Redis, not {scheme}"
    raise ConfigurationError(msg)
