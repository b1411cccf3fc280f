"""``idemflow``, the operator's command line: one module per command (``register``), failures
as one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version

from .._errors import IdempotencyError
from ._common import register_from_the_demo

__all__ = ["main"]

#: Command modules, in the order ``--help`` lists them (``module:name``: the demo's own).
COMMANDS = [
    *("_migrate", "_sweep", "_inspect", "_stats", "_purge"),
    *("idemflow_demo.cli:demo", "idemflow_demo.storm.cli:storm"),
    *("idemflow_demo.consumer_storm.cli:consumer-storm", "_audit"),
]

EXIT_FAILURE = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idemflow",
        description="Make non-idempotent HTTP writes safe to retry: operate idemflow key stores.",
    )
    parser.add_argument("--version", action="version", version=f"idemflow {version('idemflow')}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module, _, demo = name.partition(":")
        if demo:
            register_from_the_demo(subparsers, module, demo)
        else:
            importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # psycopg_pool logs every failed connect: it would bury the one line we print.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`… | head`): not our failure; a quiet final flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except IdempotencyError as exc:
        print(f"idemflow {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # noqa: BLE001 -- one line for operators, not a traceback
        print(f"idemflow {args.command}: {describe(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def describe(exc: BaseException) -> str:
    """A driver error as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
