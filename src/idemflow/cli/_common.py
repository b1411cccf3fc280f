"""Arguments every command shares: the database URL (or IDEMFLOW_DATABASE_URL) and the table."""

from __future__ import annotations

import argparse
import os

from .._errors import ConfigurationError
from ..stores.urls import DATABASE_URL_ENV

__all__ = ["add_database_arguments", "database_url"]


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "database_url",
        nargs="?",
        metavar="DATABASE_URL",
        help=(
            "sqlite:///path.db, postgresql://user@host/db, mysql://user@host/db or "
            f"redis://host:port/0 (default: ${DATABASE_URL_ENV})"
        ),
    )
    parser.add_argument(
        "--table",
        default="idemflow_keys",
        help="key table (or key prefix) name (default: %(default)s)",
    )


def database_url(args: argparse.Namespace) -> str:
    url: str | None = args.database_url or os.environ.get(DATABASE_URL_ENV)
    if not url:
        msg = f"no DATABASE_URL given and ${DATABASE_URL_ENV} is not set"
        raise ConfigurationError(msg)
    return url
