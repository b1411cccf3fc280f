"""What the commands share: the database arguments, argparse types, the demo's loader."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any

from .._errors import ConfigurationError
from ..stores.urls import DATABASE_URL_ENV


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


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        msg = f"must be a positive number of seconds, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        msg = f"must be a whole number of at least 1, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return int(text)


DEMO_INSTALL = (
    "the demo is its own distribution, idemflow-demo, and is not installed: from a clone of "
    "idemflow, run scripts/demo (or pip install ./demo)"
)


def add_not_installed(subparsers: argparse._SubParsersAction[Any], name: str, hint: str) -> None:
    """Lists ``name`` in ``--help`` and answers any use of it (``--help`` too) with ``hint``."""
    parser = subparsers.add_parser(
        name, help="(not installed) " + hint, add_help=False, prefix_chars="\0"
    )
    parser.add_argument("arguments", nargs="*")

    def run(args: argparse.Namespace) -> int:
        raise ConfigurationError(hint)

    parser.set_defaults(run=run)


def register_from_the_demo(
    subparsers: argparse._SubParsersAction[Any], module: str, name: str
) -> None:
    """Register ``name`` from the demo's distribution, or a stand-in saying how to install it."""
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".", maxsplit=1)[0]:
            raise  # the demo is there, something it needs is not: say that
        add_not_installed(subparsers, name, DEMO_INSTALL)
        return
    loaded.register(subparsers)
