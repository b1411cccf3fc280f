"""
What metrics, traces and logs cost a protected operation.

Run::

    .venv/bin/python -m bench.bench_observability [--seconds N] [--slices N]
                                                  [--threads 16] [--backends sqlite,postgres]

For each backend, ``Idempotency.run`` with a fresh key and a trivial handler
(claim, handler, completion) runs on ``--threads`` threads, four ways:

``plain``
    no observer.
``metrics+logs``
    ``observer=fan_out(PrometheusMetrics, LoggingObserver)``: Prometheus
    counters and histograms (the stuck-claims gauge registered too), and the
    logging observer with the ``idemflow`` loggers at INFO writing to a
    handler (the normal paths log at DEBUG, so they are filtered).
``metrics+logs+traces``
    the same inside ``traced(...)``: an OpenTelemetry SDK tracer provider,
    every trace sampled, a ``BatchSpanProcessor`` feeding a no-op exporter
    (each span is built, attributed, ended and handed off).
``…+traces 10 %``
    the same with ``ParentBased(TraceIdRatioBased(0.1))``, a common
    production sampler: nine runs in ten get a non-recording span.

They take turns in short slices (A B C D, B C D A, …; see
:mod:`bench._harness`) on the same table, in one run. Each is compared with
``plain``; the target is ≥ 0.95 × plain.

A second table gives the same four on the in-memory store, one thread, as
microseconds per run (the best of several repetitions): what each instrument
adds to every protected request in absolute terms, without a database's
noise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import logging
import os
import platform
import sys
import tempfile
import threading
import timeit
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from bench._harness import Contender, Crew, Row, interleave, parse_list, table
from idemflow import Idempotency, Intent, Policy, Response, fan_out
from idemflow.logs import LoggingObserver
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.memory import MemoryStore
from idemflow.tracing import traced

POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
TARGET = 0.95
RESPONSE = Response.json(201, {"id": 1, "status": "succeeded"})
FINGERPRINT = "sha256:" + "ab" * 32


class NoOpExporter(SpanExporter):
    """Accepts every batch and drops it: the cost measured is ours, not a collector's."""

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def handler(attempt: object) -> Response:
    return RESPONSE


def operation(idem: Idempotency, prefix: str) -> Any:
    """One protected request with a key never seen before."""
    keys = itertools.count()

    def op() -> None:
        key = f"{prefix}-{threading.get_ident()}-{next(keys)}"
        idem.run(Intent("alice", key, FINGERPRINT, endpoint="POST /payments"), handler)

    return op


@contextlib.contextmanager
def instrumentation() -> Iterator[tuple[PrometheusMetrics, LoggingObserver]]:
    logger = logging.getLogger("idemflow")
    handler = logging.StreamHandler(io.StringIO())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield PrometheusMetrics(), LoggingObserver()
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def tracer_provider(ratio: float) -> Iterator[TracerProvider]:
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(NoOpExporter()))
    try:
        yield provider
    finally:
        provider.shutdown()


@contextlib.contextmanager
def contenders_on(store: Any) -> Iterator[dict[str, Idempotency]]:
    """The four ways to run, on ``store``."""
    with (
        instrumentation() as (metrics, logs),
        tracer_provider(1.0) as always,
        tracer_provider(0.1) as sampled,
    ):
        metrics.watch_stale_claims(store, 30)
        policy = Policy(request_timeout=30)
        observed = Idempotency(store, policy, observer=fan_out(metrics, logs))
        yield {
            "plain": Idempotency(store, policy),
            "metrics+logs": observed,
            "metrics+logs+traces": traced(observed, always.get_tracer("bench")),
            "…+traces 10 %": traced(observed, sampled.get_tracer("bench")),
        }


@contextlib.contextmanager
def contenders(store: Any, crew: Crew) -> Iterator[list[Contender]]:
    with contenders_on(store) as sides:
        yield [Contender(name, crew.slice(operation(idem, name))) for name, idem in sides.items()]


def per_run_costs(rounds: int = 9, number: int = 2000) -> str:
    """Microseconds per run on the memory store, one thread: a Markdown table.

    The four take turns, ``rounds`` times; each keeps its best round (timeit's
    way of discounting whatever else the machine was doing).
    """
    best: dict[str, float] = {}
    with contenders_on(MemoryStore()) as sides:
        ops = {name: operation(idem, f"micro-{name}") for name, idem in sides.items()}
        for _ in range(rounds):
            for name, op in ops.items():
                seconds = timeit.timeit(op, number=number) / number
                best[name] = min(best.get(name, seconds), seconds)
    plain = best["plain"]
    lines = ["| instruments | µs per run | added µs |", "| --- | ---: | ---: |"]
    lines += [
        f"| {name} | {seconds * 1e6:.1f} | {(seconds - plain) * 1e6:+.1f} |"
        for name, seconds in best.items()
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def sqlite_store() -> Iterator[Any]:
    from idemflow.stores.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteStore(Path(folder) / "bench.db")
        store.migrate()
        yield store


@contextlib.contextmanager
def postgres_store() -> Iterator[Any]:
    import psycopg

    from idemflow.stores.postgres import PostgresStore

    table = f"bench_obs_{os.getpid()}"
    store = PostgresStore(POSTGRES_URL, table=table, max_size=8)
    try:
        store.migrate()
        yield store
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


STORES = {"sqlite": sqlite_store, "postgres": postgres_store}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20, help="measured seconds per side")
    parser.add_argument("--slices", type=int, default=10, help="turns per side")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--backends", type=parse_list, default=["sqlite", "postgres"])
    args = parser.parse_args(argv)
    rows = []
    with Crew(args.threads) as crew:
        for backend in args.backends:
            with STORES[backend]() as store, contenders(store, crew) as sides:
                results = interleave(sides, seconds=args.seconds, slices=args.slices)
            rows += [
                Row.compare(backend, side.name, args.threads, results, "plain", side.name)
                for side in sides[1:]
            ]
            print(f"{backend}: done", file=sys.stderr)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {args.threads} threads")
    print(table(rows, headers=("plain ops/s", "instrumented ops/s")))
    print()
    print(per_run_costs())
    missed = [row for row in rows if row.ratio < TARGET]
    for row in missed:
        print(f"target missed: {row.backend}, {row.path}: {row.ratio:.3f} < {TARGET}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
