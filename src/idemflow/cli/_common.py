"""What the commands share: arguments and argparse types, the store opened with a clear
error, printing for people (Rich, imported here only, or plain text) or scripts (``--json``)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

from .._errors import ConfigurationError, StoreUnavailable
from ..stores.protocol import MaintainableStore
from ..stores.sql import missing_table_is_clear
from ..stores.urls import DATABASE_URL_ENV, open_store, redact, scheme_of, sqlite_path


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    urls = "sqlite:///path.db, postgresql://user@host/db, mysql://user@host/db"
    url = f"{urls} or redis://host:port/0 (default: ${DATABASE_URL_ENV})"
    parser.add_argument("database_url", nargs="?", metavar="DATABASE_URL", help=url)
    table = "key table (or key prefix) name (default: %(default)s)"
    parser.add_argument("--table", default="idemflow_keys", help=table)


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


def register_from_the_demo(
    subparsers: argparse._SubParsersAction[Any], module: str, name: str
) -> None:
    """Register ``name`` from the demo's distribution, or a stand-in saying how to install it
    (listed in ``--help``, answering any use of it, ``--help`` too, with that)."""
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".", maxsplit=1)[0]:
            raise  # the demo is there, something it needs is not: say that
    else:
        loaded.register(subparsers)
        return
    parser = subparsers.add_parser(
        name, help="(not installed) " + DEMO_INSTALL, add_help=False, prefix_chars="\0"
    )
    parser.add_argument("arguments", nargs="*")

    def run(args: argparse.Namespace) -> int:
        raise ConfigurationError(DEMO_INSTALL)

    parser.set_defaults(run=run)


# Enough for a table of endpoints without wrapping when output is not a terminal.
_PIPE_WIDTH = 160
_CONNECT_TIMEOUT_SECONDS = 5


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print JSON for scripts instead of tables"
    )


@contextmanager
def operated_store(args: argparse.Namespace) -> Iterator[MaintainableStore]:
    """The store named by the command line, checked reachable first, closed afterwards."""
    url = database_url(args)
    require_sqlite_file(url)
    _check_reachable(url, scheme_of(url))
    store = open_store(url, table=args.table)
    try:
        with missing_table_is_clear(args.table):
            yield store
    finally:
        store.close()


def require_sqlite_file(url: str) -> None:
    """A missing SQLite file is a typo, never a new (empty) database: sqlite3 would create it."""
    if scheme_of(url) != "sqlite":
        return
    path = sqlite_path(url)
    if not os.path.isfile(path):
        msg = f"no SQLite database at {path!r}: the file does not exist (check the path, or "
        msg += f"create it with: idemflow migrate {url})"
        raise ConfigurationError(msg)


def _check_reachable(url: str, scheme: str) -> None:
    """Fail fast with the real reason, before a pool retries in the background."""
    if scheme == "postgresql":
        try:
            import psycopg
        except ImportError:
            return  # open_store says which extra to install
        conninfo = url.replace("postgres://", "postgresql://", 1)
        try:
            psycopg.connect(conninfo, connect_timeout=_CONNECT_TIMEOUT_SECONDS).close()
        except psycopg.Error as exc:
            raise _unreachable(url, str(exc)) from exc
    elif scheme == "mysql":
        try:
            import pymysql
        except ImportError:
            return  # open_store says which extra to install
        from ..stores.mysql import connect_kwargs

        try:
            pymysql.connect(**connect_kwargs(url), connect_timeout=_CONNECT_TIMEOUT_SECONDS).close()
        except pymysql.err.MySQLError as exc:
            # PyMySQL's message is its args: (1049, "Unknown database 'x'") → the text.
            raise _unreachable(url, str(exc.args[-1] if exc.args else exc)) from exc


def _unreachable(url: str, reason: str) -> StoreUnavailable:
    first_line = (reason.strip().splitlines() or ["no reason given"])[0]
    return StoreUnavailable(f"cannot reach {redact(url)}: {first_line}")


def iso(epoch_seconds: float) -> str:
    """``2026-05-01T12:00:00.000Z``: ISO-8601, UTC, milliseconds (what records store)."""
    moment = datetime.fromtimestamp(epoch_seconds, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def age(seconds: float) -> str:
    """``2h 05m 03s``: a duration for people."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{seconds:.1f}s" if seconds < 10 else f"{secs}s"


def print_json(data: Any, out: TextIO | None = None) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False), file=out or sys.stdout)


def rich_console(file: TextIO | None = None) -> Any | None:
    """A Rich console on ``file`` (stdout), or None when Rich is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    stream = file or sys.stdout
    width = None if stream.isatty() else _PIPE_WIDTH
    return Console(file=stream, width=width, highlight=False)


def print_table(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    numeric: int = 0,
    pairs: bool = False,
) -> None:
    """A table with ``headers`` (``pairs``: a field/value table, in bold, without them);
    the last ``numeric`` columns are right-aligned."""
    console = rich_console()
    if console is None:
        _plain_table(title, headers, rows, numeric)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_header=not pairs)
    for index, header in enumerate(headers):
        right = index >= len(headers) - numeric
        style = "bold" if pairs and index == 0 else ""
        table.add_column(header, justify="right" if right else "left", style=style, overflow="fold")
    for row in rows:  # Text, not markup: a key or a body may contain "[...]"
        table.add_row(*(Text(_cell(cell)) for cell in row))
    console.print(table)


def print_pairs(title: str, pairs: Sequence[tuple[str, Any]]) -> None:
    print_table(title, ("field", "value"), pairs, pairs=True)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _plain_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: int
) -> None:
    cells = [[_cell(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(title)
    for row in cells:
        parts = [
            cell.rjust(width) if i >= len(headers) - numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(parts).rstrip())


class _IntermixedParser(argparse.ArgumentParser):
    """Accepts positionals on both sides of options (``URL --principal P KEY``)."""

    _inside = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # parse_known_intermixed_args calls back: only the outermost call switches to it.
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (made by ``add_parser``), taking positionals after options too: plain
    argparse would take URL as the key in ``inspect URL --principal P KEY``."""
    parser.__class__ = _IntermixedParser
    return parser
