"""``idemflow purge``: delete records past their retention, in bounded batches."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

from .._errors import ConfigurationError, StoreUnavailable
from ..stores.protocol import MaintainableStore, Store
from ._common import (
    add_database_arguments,
    add_json_argument,
    operated_store,
    positive_int,
    positive_seconds,
    rich_console,
)

DEFAULT_BATCH = 1000

#: Told how many records each batch deleted, and whether it was the last.
Progress: TypeAlias = Callable[[int, bool], None]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "purge",
        help="delete records past their retention (once, or --every SECONDS)",
        description=(
            "Delete key records whose retention has passed, through the expiry index, "
            "in batches of --batch records: each batch is one short statement, so no "
            "lock is held for long. Records past their retention are already treated "
            "as absent by the next claim; purging only reclaims their space. Shows "
            "progress on a terminal and prints a summary. On Redis, settled records also "
            "expire by TTL; purge removes them by this host's clock, with their index entries."
        ),
    )
    add_database_arguments(parser)
    per = "records deleted per statement (default: %(default)s)"
    parser.add_argument("--batch", type=positive_int, default=DEFAULT_BATCH, metavar="N", help=per)
    every = "keep running, purging every SECONDS (stop with Ctrl-C or SIGTERM)"
    parser.add_argument("--every", type=positive_seconds, metavar="SECONDS", help=every)
    add_json_argument(parser)
    parser.set_defaults(run=run)


@dataclass(frozen=True, slots=True)
class PurgePass:
    purged: int
    batches: int
    seconds: float


def run(args: argparse.Namespace) -> int:
    with operated_store(args) as store, _stop_on_sigterm() as stopping:
        if args.every is None:
            _report(args, purge_pass(store, args.batch, _progress(args, store), stopping))
            return 0
        while not stopping.is_set():
            # An outage fails one pass; anything else (a missing table) ends the command.
            try:
                _report(args, purge_pass(store, args.batch, _progress(args, store), stopping))
            except StoreUnavailable as exc:
                print(f"idemflow purge: pass failed: {exc}", file=sys.stderr, flush=True)
            stopping.wait(args.every)
        return 0


def purge_pass(
    store: MaintainableStore, batch: int, progress: Progress, stopping: threading.Event
) -> PurgePass:
    """Delete everything expired as of now (fixed, so the pass ends), ``batch`` records per
    statement; SIGTERM stops it between two batches."""
    started = time.monotonic()
    now = time.time()
    purged = batches = 0
    finished = False
    while not finished:
        try:
            deleted = int(store.purge(now, batch))
        except BaseException:
            progress(0, True)  # take the progress bar down before the error line
            raise
        purged += deleted
        batches += 1
        finished = deleted < batch or stopping.is_set()
        progress(deleted, finished)
    return PurgePass(purged, batches, time.monotonic() - started)


def _report(args: argparse.Namespace, done: PurgePass) -> None:
    """One line per pass: the summary, or a JSON object (JSON Lines with ``--every``)."""
    batches = f"{done.batches} batch" if done.batches == 1 else f"{done.batches} batches"
    text = (
        f"purged {done.purged} expired records from {args.table} in "
        f"{done.seconds:.2f}s ({batches} of at most {args.batch})"
    )
    if args.json:
        fields = {"purged": done.purged, "batches": done.batches, "seconds": round(done.seconds, 3)}
        print(json.dumps({"table": args.table, **fields, "message": text}), flush=True)
    else:
        print(text, flush=True)


def _progress(args: argparse.Namespace, store: Store) -> Progress:
    if args.json or not sys.stderr.isatty():
        return lambda deleted, last: None
    try:
        total = store.stats().expired(time.time())
    except ConfigurationError:
        total = None
    console = rich_console(sys.stderr)
    return _counter(total) if console is None else _bar(console, total)


def _counter(total: int | None) -> Progress:
    done = [0]
    of = f" of about {total}" if total is not None else ""

    def report(deleted: int, last: bool) -> None:
        done[0] += deleted
        end = "\n" if last else ""
        print(f"\rpurged {done[0]}{of}", end=end, file=sys.stderr, flush=True)

    return report


def _bar(console: Any, total: int | None) -> Progress:
    from rich import progress

    bar = progress.Progress(
        progress.TextColumn("purging expired records"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task("purge", total=total)
    bar.start()

    def report(deleted: int, last: bool) -> None:
        bar.advance(task, deleted)
        if last:
            bar.stop()

    return report


@contextmanager
def _stop_on_sigterm() -> Iterator[threading.Event]:
    """An event set by SIGTERM: ``--every`` ends after its current batch (exit 0)."""
    stopping = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopping  # signal handlers belong to the main thread
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    try:
        yield stopping
    finally:
        signal.signal(signal.SIGTERM, previous)
