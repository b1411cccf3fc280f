"""``idemflow migrate``: create the key table and its indexes (safe to run again)."""

from __future__ import annotations

import argparse
from typing import Any

from ..stores.urls import open_store
from ._common import add_database_arguments, database_url


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "migrate",
        help="create the key table and indexes (idempotent)",
        description=(
            "Create the key table with its unique (principal, key) constraint, the "
            "state/age index the sweeper scans and the expiry index purge uses. "
            "Running it again changes nothing."
        ),
    )
    add_database_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    url = database_url(args)
    store = open_store(url, table=args.table)
    try:
        store.migrate()
    finally:
        store.close()
    print(f"migrated {args.table} on {url.split('@')[-1]}")
    return 0
