"""
Traces through the OpenTelemetry SDK's in-memory exporter: one span per run,
its attributes, and the link from a replay to the request that was replayed.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer

from idemflow import (
    AsyncIdempotency,
    Event,
    Idempotency,
    InProgress,
    KeyReused,
    Policy,
    Response,
    StoreUnavailable,
)
from idemflow._events import CountingObserver
from idemflow._spans import linked_context
from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idemflow.testing import FrozenClock
from idemflow.tracing import TracingObserver, traced, traceparent
from tests.ops_support import created, intent

ENDPOINT = "POST /payments"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test")
    provider.shutdown()


@pytest.fixture
def store(tmp_path: Path, table_name: str) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "keys.db", table=table_name)
    store.migrate()
    return store


@pytest.fixture
def idem(store: SQLiteStore, tracer: Tracer) -> Idempotency:
    return traced(Idempotency(store, Policy(request_timeout=30)), tracer)


def runs(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == "idemflow.run"]


def only_run(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = runs(exporter)
    return span


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def test_a_first_request_is_one_span_with_outcome_state_and_endpoint(
    idem: Idempotency, exporter: InMemorySpanExporter
) -> None:
    """Claim, execute and complete happen inside one idemflow.run span."""
    idem.run(intent("k1"), created)
    span = only_run(exporter)
    assert span.attributes is not None
    assert span.attributes["idemflow.outcome"] == "claimed"
    assert span.attributes["idemflow.state"] == "completed"
    assert span.attributes["idemflow.endpoint"] == ENDPOINT
    assert span.status.status_code is StatusCode.UNSET


def test_the_run_span_is_stored_as_the_correlation_id(
    idem: Idempotency, store: SQLiteStore, exporter: InMemorySpanExporter
) -> None:
    """Without an app correlation id, the record names the run span as a W3C traceparent."""
    idem.run(intent("k1"), created)
    record = store.get("alice", "k1")
    assert record is not None
    assert record.correlation_id == traceparent_of(only_run(exporter))


def test_a_replay_span_links_to_the_original_request(
    idem: Idempotency, exporter: InMemorySpanExporter
) -> None:
    """The replay, in a trace of its own, links to the span of the request it replays."""
    idem.run(intent("k1"), created)
    idem.run(intent("k1"), created)
    original, replay = runs(exporter)
    assert replay.context is not None
    assert original.context is not None
    assert replay.context.trace_id != original.context.trace_id
    assert replay.attributes is not None
    assert replay.attributes["idemflow.outcome"] == "replayed"
    assert replay.attributes["idemflow.state"] == "completed"
    assert replay.attributes["idemflow.original_correlation_id"] == traceparent_of(original)
    (link,) = replay.links
    assert link.context.trace_id == original.context.trace_id
    assert link.context.span_id == original.context.span_id
    assert link.attributes == {"idemflow.link": "original_request"}


def test_the_run_span_is_a_child_of_the_request_span(
    idem: Idempotency, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """Inside an HTTP server span, the run joins that trace."""
    with tracer.start_as_current_span("POST /payments") as server:
        idem.run(intent("k1"), created)
    span = only_run(exporter)
    assert span.parent is not None
    assert span.parent.span_id == server.get_span_context().span_id


def test_an_app_correlation_id_is_kept_and_linked_when_it_holds_a_traceparent(
    idem: Idempotency, store: SQLiteStore, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """An app's own id is never overwritten; a traceparent inside it still links the replay."""
    with tracer.start_as_current_span("original request") as original:
        correlation = f"req-42 {traceparent()}"
        idem.run(intent("k1", correlation_id=correlation), created)
    idem.run(intent("k1", correlation_id="req-43"), created)
    record = store.get("alice", "k1")
    assert record is not None
    assert record.correlation_id == correlation
    replay = runs(exporter)[1]
    (link,) = replay.links
    assert link.context.span_id == original.get_span_context().span_id


def test_a_correlation_id_without_a_traceparent_is_reported_but_not_linked(
    idem: Idempotency, exporter: InMemorySpanExporter
) -> None:
    """No trace context to link to: the original id is still on the replay span."""
    idem.run(intent("k1", correlation_id="req-42"), created)
    idem.run(intent("k1", correlation_id="req-43"), created)
    replay = runs(exporter)[1]
    assert replay.links == ()
    assert replay.attributes is not None
    assert replay.attributes["idemflow.original_correlation_id"] == "req-42"


def test_409_and_422_are_outcomes_not_span_errors(
    idem: Idempotency, exporter: InMemorySpanExporter
) -> None:
    """A conflict and a reused key are normal answers: outcome set, status unset."""

    def first(attempt: object) -> Response:
        with pytest.raises(InProgress):
            idem.run(intent("k1"), created)
        return created(attempt)

    idem.run(intent("k1"), first)
    with pytest.raises(KeyReused):
        idem.run(intent("k1", body=b"{}"), created)
    conflict, outer, mismatch = runs(exporter)  # the nested run ends first
    assert outer.attributes is not None
    assert outer.attributes["idemflow.outcome"] == "claimed"
    for span, expected in ((conflict, "in_progress_conflict"), (mismatch, "fingerprint_mismatch")):
        assert span.attributes is not None
        assert span.attributes["idemflow.outcome"] == expected
        assert span.status.status_code is StatusCode.UNSET


def test_a_crashing_handler_marks_the_span_failed_and_the_key_released(
    idem: Idempotency, exporter: InMemorySpanExporter
) -> None:
    """The handler's exception is recorded; the state says the key was given back."""

    def crash(attempt: object) -> Response:
        raise RuntimeError("provider exploded")

    with pytest.raises(RuntimeError):
        idem.run(intent("k1"), crash)
    span = only_run(exporter)
    assert span.attributes is not None
    assert span.attributes["idemflow.outcome"] == "claimed"
    assert span.attributes["idemflow.state"] == "released"
    assert span.status.status_code is StatusCode.ERROR
    assert any(event.name == "exception" for event in span.events)


@pytest.mark.parametrize(
    ("status", "state"), [(503, "released"), (402, "failed_permanent"), (200, "completed")]
)
def test_the_state_is_what_the_response_settled_into(
    idem: Idempotency, exporter: InMemorySpanExporter, status: int, state: str
) -> None:
    """Transient answers release the key, permanent failures and successes settle it."""
    idem.run(intent("k1"), lambda attempt: Response.json(status, {}))
    span = only_run(exporter)
    assert span.attributes is not None
    assert span.attributes["idemflow.state"] == state
    assert span.status.status_code is StatusCode.UNSET


def test_an_unreachable_store_is_a_span_error(
    tmp_path: Path, table_name: str, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """A store outage fails the span with the exception recorded."""
    path = tmp_path / "keys.db"
    SQLiteStore(path, table=table_name).migrate()
    idem = traced(Idempotency(SQLiteStore(path, table=table_name, busy_timeout=0.05)), tracer)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable):
            idem.run(intent("k1"), created)
    finally:
        blocker.close()
    span = only_run(exporter)
    assert span.attributes is not None
    assert span.attributes["idemflow.outcome"] == "store_unavailable"
    assert span.status.status_code is StatusCode.ERROR


def test_traced_keeps_the_store_policy_and_observer(
    store: SQLiteStore, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """The wrapper is the same Idempotency, plus spans: metrics still count."""
    counter = CountingObserver()
    policy = Policy(request_timeout=5)
    clock = FrozenClock()
    inner = Idempotency(store, policy, clock=clock, observer=counter)
    idem = traced(inner, tracer)
    assert isinstance(idem, Idempotency)
    assert (idem.store, idem.policy, idem.clock) == (store, policy, clock)
    idem.run(intent("k1"), created)
    assert counter.total(Event.CLAIMED) == 1
    assert len(runs(exporter)) == 1


@pytest.mark.anyio
async def test_the_async_driver_is_traced_the_same_way(
    tmp_path: Path, table_name: str, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """AsyncIdempotency: one span per run, and the replay linked."""
    store = AsyncSQLiteStore(tmp_path / "keys.db", table=table_name)
    await store.migrate()
    idem = traced(AsyncIdempotency(store), tracer)

    async def handler(attempt: object) -> Response:
        return created(attempt)

    await idem.run(intent("k1"), handler)
    outcome = await idem.run(intent("k1"), handler)
    assert outcome.replayed
    original, replay = runs(exporter)
    assert replay.attributes is not None
    assert replay.attributes["idemflow.outcome"] == "replayed"
    (link,) = replay.links
    assert original.context is not None
    assert link.context.span_id == original.context.span_id


def test_the_observer_alone_annotates_the_current_span(
    store: SQLiteStore, tracer: Tracer, exporter: InMemorySpanExporter
) -> None:
    """Without traced(), TracingObserver writes onto the app's own span."""
    idem = Idempotency(store, observer=TracingObserver())
    with tracer.start_as_current_span("POST /payments"):
        idem.run(intent("k1"), created)
        idem.run(intent("k1"), created)
    (server,) = exporter.get_finished_spans()
    assert server.attributes is not None
    assert server.attributes["idemflow.outcome"] == "replayed"
    assert server.attributes["idemflow.endpoint"] == ENDPOINT
    names = [event.name for event in server.events]
    assert names == ["idemflow.claimed", "idemflow.completed", "idemflow.replayed"]


def test_a_traceparent_round_trips_and_garbage_links_nothing() -> None:
    """Only a well-formed, non-zero traceparent becomes a span context."""
    context = linked_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert context is not None
    assert context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert context.is_remote
    assert linked_context(None) is None
    assert linked_context("req-42") is None
    assert linked_context("00-" + "0" * 32 + "-" + "0" * 16 + "-01") is None


def test_without_opentelemetry_everything_is_a_no_op(tmp_path: Path) -> None:
    """With opentelemetry not importable, traced() returns its argument and runs still work."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # what an install without it looks like
        from idemflow import Idempotency, Intent, Response
        from idemflow.stores.sqlite import SQLiteStore
        from idemflow import _spans, tracing

        store = SQLiteStore({str(tmp_path / "keys.db")!r})
        store.migrate()
        idem = Idempotency(store, observer=tracing.TracingObserver())
        assert tracing.traced(idem) is idem
        assert tracing.traceparent() is None and not _spans.ENABLED
        outcome = idem.run(Intent("a", "k", "sha256:x"), lambda attempt: Response(201))
        assert outcome.response.status == 201
        assert "opentelemetry.trace" not in sys.modules
        print("no-op ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no-op ok"


def test_a_sampled_out_run_exports_nothing_and_still_names_its_trace(
    store: SQLiteStore, exporter: InMemorySpanExporter
) -> None:
    """Not sampled: no span is exported, the run works, the record still carries the traceparent."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    idem = traced(Idempotency(store), provider.get_tracer("test"))
    idem.run(intent("k1"), created)
    assert idem.run(intent("k1"), created).replayed
    assert exporter.get_finished_spans() == ()
    record = store.get("alice", "k1")
    assert record is not None
    assert linked_context(record.correlation_id) is not None
    provider.shutdown()
