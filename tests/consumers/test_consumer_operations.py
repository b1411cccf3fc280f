"""Operators see consumers as they see requests: the metrics count each outcome under the
consumer's scope (its queue), each delivery is a span named by it, and ``idemflow stats`` /
``inspect`` show its records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, Response
from idemflow.cli import main
from idemflow.consumers import AsyncConsumer
from idemflow.consumers._decision import Action
from idemflow.stores.sqlite import AsyncSQLiteStore
from tests.factories import POLICY

pytestmark = pytest.mark.anyio


async def charged(attempt: AsyncAttempt) -> Any:
    return {"charged": attempt.record.key}


async def provider_down(attempt: AsyncAttempt) -> Any:
    return Response.json(503, {"error": "provider down"})


async def test_outcomes_are_counted_and_listed_per_queue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = pytest.importorskip("idemflow.metrics").PrometheusMetrics()
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(str(path))
    await store.migrate()
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from idemflow.tracing import traced

    spans, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    idem = traced(AsyncIdempotency(store, POLICY, observer=metrics), provider.get_tracer("t"))
    orders, refunds = AsyncConsumer(idem, "orders"), AsyncConsumer(idem, "refunds")
    try:
        assert (await orders.handle("o-1", b"{}", charged)).action is Action.ACK
        assert (await orders.handle("o-1", b"{}", charged)).action is Action.ACK_WITH_STORED_RESULT
        assert (await orders.handle("o-1", b'{"x":1}', charged)).action is Action.DEAD_LETTER
        assert (await refunds.handle("r-1", b"{}", provider_down)).action is (
            Action.RELEASE_AND_REQUEUE
        )
        assert (await refunds.handle("r-2", b"{}", charged)).action is Action.ACK
    finally:
        await store.close()

    def counted(outcome: str, queue: str) -> float:
        labels = {"outcome": outcome, "endpoint": queue}
        return metrics.registry.get_sample_value("idemflow_requests_total", labels) or 0.0

    assert counted("claimed", "orders") == 1
    assert counted("replayed", "orders") == 1
    assert counted("fingerprint_mismatch", "orders") == 1
    assert counted("claimed", "refunds") == 2
    assert counted("released", "refunds") == 1
    assert counted("replayed", "refunds") == 0

    queues = [
        (span.attributes or {}).get("idemflow.endpoint")
        for span in spans.get_finished_spans()
        if span.name == "idemflow.run"
    ]
    assert queues == ["orders"] * 3 + ["refunds"] * 2  # one span per delivery

    url = f"sqlite:///{path}"
    assert main(["stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    per_queue = {
        (row["endpoint"], row["state"]): row["count"] for row in stats["by_state_and_endpoint"]
    }
    assert per_queue == {
        ("orders", "completed"): 1,
        ("refunds", "completed"): 1,
        ("refunds", "released"): 1,  # given back, free for the redelivery
    }

    assert main(["inspect", url, "--principal", "orders", "o-1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["endpoint"], record["state"]) == ("orders", "completed")
