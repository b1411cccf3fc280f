"""
Prometheus metrics for idemflow (needs ``prometheus-client``: ``idemflow[metrics]``).

Pass a :class:`PrometheusMetrics` as the ``observer=`` of an ``Idempotency``.
Labels are bounded: ``endpoint`` is the route template (``POST /payments``),
never the raw path, and the key or principal never appear.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from ._events import Event
from ._model import Intent

__all__ = ["PrometheusMetrics"]

# Claims and replays are one or two indexed statements: most land in
# milliseconds, the tail shows a saturated pool or a lock queue.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusMetrics:
    """An observer that counts every outcome and times claims and replays.

    Metrics: ``idemflow_requests_total{outcome, endpoint}``,
    ``idemflow_claim_seconds{endpoint}``, ``idemflow_replay_seconds{endpoint}``.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, namespace: str = "idemflow"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "requests",
            "Idempotency outcomes by kind and endpoint",
            ["outcome", "endpoint"],
            namespace=namespace,
            registry=self.registry,
        )
        self.claim_seconds = self._histogram(namespace, "claim_seconds", "Time to claim a key")
        self.replay_seconds = self._histogram(
            namespace, "replay_seconds", "Time to answer a request with a stored response"
        )

    def _histogram(self, namespace: str, name: str, documentation: str) -> Histogram:
        return Histogram(
            name,
            documentation,
            ["endpoint"],
            namespace=namespace,
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        endpoint = intent.endpoint or "unknown"
        self.requests.labels(event.value, endpoint).inc()
        if event is Event.CLAIMED:
            self.claim_seconds.labels(endpoint).observe(elapsed)
        elif event is Event.REPLAYED:
            self.replay_seconds.labels(endpoint).observe(elapsed)

    def count(self, event: Event, endpoint: str) -> float:
        """The counter's current value (for tests and the storm's verdict)."""
        value: Any = self.registry.get_sample_value(
            "idemflow_requests_total", {"outcome": event.value, "endpoint": endpoint}
        )
        return float(value or 0.0)
