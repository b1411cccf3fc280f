"""Prometheus metrics (``idemflow[metrics]``): a `PrometheusMetrics` as the ``observer=``,
labelled by route template only. Metrics, PromQL, alerts: docs/operations.md, "Metrics"."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ._deprecation import moved
from ._events import Event
from ._extras import optional
from ._model import Clock, Duration, Intent, seconds
from .stores.protocol import Store
from .stores.stats import STUCK_STATES, StatsSource

with optional("idemflow.metrics"):
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector

__all__ = ["PrometheusMetrics"]

logger = logging.getLogger("idemflow.metrics")

# One or two indexed statements: milliseconds; the tail shows a saturated pool or lock.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_RESOLUTIONS = ("completed", "released", "unknown")

#: A scrape reuses the stuck-claim count this long: one COUNT per interval, not per scraper.
DEFAULT_GAUGE_CACHE_SECONDS = 5.0


class PrometheusMetrics:
    """An observer that counts every outcome and times claims and replays, in ``registry``
    (a new one unless given) under the ``namespace`` prefix."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, namespace: str = "idemflow"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.namespace = namespace
        where: Any = {"namespace": namespace, "registry": self.registry}
        outcomes = "Idempotency outcomes by kind and endpoint"
        self.requests = Counter("requests", outcomes, ["outcome", "endpoint"], **where)
        timed = {**where, "buckets": LATENCY_BUCKETS}
        claim, replay = "Time to claim a key", "Time to answer a request with a stored response"
        self.claim_seconds = Histogram("claim_seconds", claim, ["endpoint"], **timed)
        self.replay_seconds = Histogram("replay_seconds", replay, ["endpoint"], **timed)
        resolved = "Stale claims the sweeper resolved, by resolution"
        self.stale_reclaimed_total = Counter("stale_reclaimed", resolved, ["resolution"], **where)
        for resolution in _RESOLUTIONS:  # present at 0, so rate() works from the start
            self.stale_reclaimed_total.labels(resolution)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        endpoint = intent.endpoint or "unknown"
        self._child(self.requests, event.value, endpoint).inc()
        if event is Event.CLAIMED:
            self._child(self.claim_seconds, endpoint).observe(elapsed)
        elif event is Event.REPLAYED:
            self._child(self.replay_seconds, endpoint).observe(elapsed)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: labels() costs more than the increment."""
        slot = (metric, labels)
        child = self._children.get(slot)
        if child is None:
            child = self._children.setdefault(slot, metric.labels(*labels))
        return child

    def stale_reclaimed(self, resolution: str, endpoint: str) -> None:
        """Count one stale claim the sweeper resolved (``completed``, ``released``, ``unknown``)."""
        self.stale_reclaimed_total.labels(resolution).inc()

    def watch_stale_claims(
        self,
        store: Store,
        request_timeout: Duration,
        *,
        cache_seconds: float = DEFAULT_GAUGE_CACHE_SECONDS,
        clock: Clock = time.time,
    ) -> None:
        """Export ``idemflow_stale_in_progress{state}`` from a sync ``store`` at scrape time:
        ``in_progress`` past ``request_timeout`` and ``stale``, one COUNT per cache_seconds."""
        name, timeout = f"{self.namespace}_stale_in_progress", seconds(request_timeout)
        self.registry.register(StuckClaimsGauge(name, store.stats(), timeout, cache_seconds, clock))

    def count(self, event: Event, endpoint: str) -> float:
        """The counter's current value (for tests and the storm's verdict)."""
        value: Any = self.registry.get_sample_value(
            f"{self.namespace}_requests_total", {"outcome": event.value, "endpoint": endpoint}
        )
        return float(value or 0.0)


@dataclass(eq=False)  # a registry keys its collectors by identity
class StuckClaimsGauge(Collector):
    """A collector that counts stuck claims in the store when scraped (cached)."""

    name: str
    source: StatsSource
    request_timeout: float
    cache_seconds: float
    clock: Clock
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _cached: tuple[float, dict[str, int]] | None = field(default=None, init=False)

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        if counts is None:
            return  # no sample beats a wrong one; the warning says why
        family = self._family()
        for state in STUCK_STATES:
            family.add_metric([state.value], counts.get(state.value, 0))
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            self.name,
            "Claims older than the request timeout (in_progress) or swept and unresolved (stale)",
            labels=["state"],
        )

    def _counts(self) -> dict[str, int] | None:
        with self._lock:  # concurrent scrapes share one query
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.cache_seconds:
                return self._cached[1]
            try:
                counts = self.source.stuck_claims(now - self.request_timeout)
            except Exception:
                table = self.source.table
                logger.warning("could not count stuck claims in %s", table, exc_info=True)
                self._cached = None
                return None
            self._cached = (now, counts)
            return counts


__getattr__ = moved(__name__, {"RESOLUTIONS": "idemflow.metrics:_RESOLUTIONS"})
