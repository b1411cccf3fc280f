"""``idemflow sweep``: resolve stale ``in_progress`` claims, once or every N seconds."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import ConfigurationError
from .._model import Policy
from ..stores.protocol import Transaction
from ..stores.urls import open_store, scheme_of, sqlite_path
from ..sweeper import DEFAULT_BATCH_SIZE, Reconciler, Stop, Sweeper, SweepReport
from . import describe
from ._common import (
    add_database_arguments,
    database_url,
    positive_int,
    positive_seconds,
    require_sqlite_file,
)

DEFAULT_REQUEST_TIMEOUT = 30.0  # a common proxy limit; operators should pass their own
DEFAULT_RETENTION = 24 * 3600.0


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sweep",
        help="resolve stale in_progress claims (once, or --every SECONDS)",
        description=(
            "Mark in_progress claims past their own stale threshold (each claim carries the "
            "one of the policy it was claimed under) as stale and resolve them: release "
            "them (no reconciler: the effect was local and rolled back) or ask --reconciler "
            "what happened. --stale-after (derived from --request-timeout: 2 × timeout + "
            "10 s; a lower one is rejected) is how long an unknown outcome waits before it "
            "is asked again. Safe to run in several processes at once."
        ),
    )
    add_database_arguments(parser)
    add = parser.add_argument
    seconds: Any = {"type": positive_seconds, "metavar": "SECONDS"}
    app = "use your app's value (default: %(default)g)"
    timeout = f"the longest a protected request can run; {app}"
    add("--request-timeout", **seconds, default=DEFAULT_REQUEST_TIMEOUT, help=timeout)
    stale = "when an unknown outcome is asked again (default and minimum: 2 × timeout + 10)"
    add("--stale-after", **seconds, help=stale)
    retention = f"how long unresolved stale records are kept; {app}"
    add("--retention", **seconds, default=DEFAULT_RETENTION, help=retention)
    per = "records marked per statement (default: %(default)s)"
    add("--batch", type=positive_int, default=DEFAULT_BATCH_SIZE, metavar="N", help=per)
    every = "sweep again every SECONDS until SIGINT/SIGTERM (default: sweep once)"
    add("--every", **seconds, help=every)
    asked = "a Reconciler to ask about external effects instead of releasing"
    add("--reconciler", metavar="MODULE:NAME", help=asked)
    step = "a step whose downstream key the reconciler gets (repeatable)"
    add("--step", action="append", default=[], metavar="NAME", help=step)
    add("--json", action="store_true", help="print one JSON object per pass")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Before touching the database: an unsafe threshold fails fast, with the policy's words.
    policy = Policy(
        request_timeout=args.request_timeout,
        stale_after=args.stale_after,
        retention=args.retention,
    )
    url = database_url(args)
    reconciler = _load_reconciler(args.reconciler) if args.reconciler else None
    require_sqlite_file(url)
    store = open_store(url, table=args.table, policy=policy)
    try:
        sweeper = Sweeper(
            store,
            policy,
            reconciler=reconciler,
            steps=args.step,
            transaction_factory=_transactions(url) if reconciler else None,
            batch_size=args.batch,
        )
        _sweep(sweeper, args)
    finally:
        store.close()
    return 0


def _sweep(sweeper: Sweeper, args: argparse.Namespace) -> None:
    # The sweeper logs reconciler failures: shown as our lines.
    logging.basicConfig(format="idemflow sweep: %(message)s", level=logging.WARNING)
    printer = _Printer(args, sweeper.policy)
    if args.every is None:
        printer.done(sweeper.sweep_once(printer.progress))
        return
    stop = Stop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.is_set():
        try:
            printer.done(sweeper.sweep_once(printer.progress))
        except Exception as exc:  # noqa: BLE001 -- the next pass may succeed
            print(f"idemflow sweep: pass failed: {describe(exc)}", file=sys.stderr, flush=True)
        if stop.wait(args.every):
            return


class _Printer:
    def __init__(self, args: argparse.Namespace, policy: Policy) -> None:
        self._json = args.json
        self._table = args.table
        self._stale_after = policy.stale_seconds
        self._started = time.monotonic()

    def progress(self, report: SweepReport) -> None:
        print(
            f"idemflow sweep: … {report.resolved + report.lost} records after "
            f"{report.batches} batches",
            file=sys.stderr,
            flush=True,
        )

    def done(self, report: SweepReport) -> None:
        elapsed = time.monotonic() - self._started
        self._started = time.monotonic()
        if self._json:
            fields = {**report.as_dict(), "stale_after": self._stale_after}
            print(json.dumps({**fields, "elapsed": round(elapsed, 3)}), flush=True)
            return
        print(
            f"swept {self._table} (stale after {self._stale_after:g}s): "
            f"{report.completed} completed, {report.released} released, "
            f"{report.unknown} unknown, {report.lost} resolved elsewhere "
            f"({report.retried} retried) in {elapsed:.2f}s",
            flush=True,
        )


def _load_reconciler(spec: str) -> Reconciler:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        msg = f"--reconciler takes MODULE:NAME, got {spec!r}"
        raise ConfigurationError(msg)
    try:
        reconciler: Reconciler = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot load reconciler {spec!r}: {exc}"
        raise ConfigurationError(msg) from exc
    return reconciler


def _transactions(url: str) -> Callable[[], contextlib.AbstractContextManager[Transaction]] | None:
    """Transactions on the key store's own database, for ``Happened.apply``."""
    family = scheme_of(url)

    # The adapters take Statement, the protocol a Statement: typed Any here.
    @contextlib.contextmanager
    def sqlite() -> Iterator[Any]:
        from ..stores.sqlite import connect
        from ..transactions import SQLite3Transaction

        with contextlib.closing(connect(sqlite_path(url))) as conn:
            yield SQLite3Transaction(conn, immediate=True)

    @contextlib.contextmanager
    def postgres() -> Iterator[Any]:
        import psycopg

        from ..transactions import PsycopgTransaction

        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
            yield PsycopgTransaction(conn)

    return {"sqlite": sqlite, "postgresql": postgres}.get(family)
