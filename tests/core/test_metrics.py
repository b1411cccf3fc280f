"""
Metrics read the way Prometheus reads them: scripted request sequences against
a real SQLite (or PostgreSQL) store, then a real HTTP scrape of ``/metrics``.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from idemflow import (
    Event,
    Idempotency,
    InProgress,
    KeyReused,
    OutcomeUnknown,
    Policy,
    Response,
    State,
    StoreUnavailable,
    fan_out,
)
from idemflow.logs import LoggingObserver
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.sqlite import SQLiteStore
from idemflow.testing import FrozenClock
from tests.ops_support import (
    Samples,
    crash_after_claim,
    created,
    intent,
    metrics_endpoint,
    open_store,
    value,
)

REQUESTS = "idemflow_requests_total"
ENDPOINT = "POST /payments"
START = 1_800_000_000.0


@pytest.fixture
def metrics() -> PrometheusMetrics:
    return PrometheusMetrics()


@pytest.fixture
def scrape(metrics: PrometheusMetrics) -> Iterator[Callable[[], Samples]]:
    with metrics_endpoint(metrics.registry) as scrape:
        yield scrape


@pytest.fixture
def store(tmp_path: Path, table_name: str) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "keys.db", table=table_name)
    store.migrate()
    return store


@pytest.fixture
def idem(store: SQLiteStore, metrics: PrometheusMetrics) -> Idempotency:
    return Idempotency(
        store, Policy(request_timeout=30), clock=FrozenClock(START), observer=metrics
    )


def outcome(samples: Samples, name: str, endpoint: str = ENDPOINT) -> float:
    return value(samples, REQUESTS, outcome=name, endpoint=endpoint)


def test_a_first_request_counts_claimed_and_completed_and_times_the_claim(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """One request: claimed and completed once each, one claim latency observation."""
    idem.run(intent("k1"), created)
    samples = scrape()
    assert outcome(samples, "claimed") == 1
    assert outcome(samples, "completed") == 1
    assert outcome(samples, "replayed") == 0
    assert value(samples, "idemflow_claim_seconds_count", endpoint=ENDPOINT) == 1


def test_a_replay_increments_replayed_and_times_the_replay(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """The retry of a completed request is counted as replayed, not claimed again."""
    idem.run(intent("k1"), created)
    idem.run(intent("k1"), created)
    idem.run(intent("k1"), created)
    samples = scrape()
    assert outcome(samples, "claimed") == 1
    assert outcome(samples, "replayed") == 2
    assert value(samples, "idemflow_replay_seconds_count", endpoint=ENDPOINT) == 2


def test_a_reused_key_422_increments_fingerprint_mismatch(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """The same key for a different body is a fingerprint mismatch."""
    idem.run(intent("k1"), created)
    with pytest.raises(KeyReused):
        idem.run(intent("k1", body=b'{"amount":5}'), created)
    samples = scrape()
    assert outcome(samples, "fingerprint_mismatch") == 1
    assert outcome(samples, "replayed") == 0


def test_a_concurrent_duplicate_409_increments_in_progress_conflict(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """A duplicate arriving while the first is running is an in-progress conflict."""

    def first(attempt: object) -> Response:
        with pytest.raises(InProgress):
            idem.run(intent("k1"), created)  # the retry, while we still hold the claim
        return created(attempt)

    idem.run(intent("k1"), first)
    samples = scrape()
    assert outcome(samples, "in_progress_conflict") == 1
    assert outcome(samples, "claimed") == 1
    assert outcome(samples, "completed") == 1


def test_a_transient_failure_increments_released(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """A 503 and a crashing handler both give the key back: two releases, no completion."""

    def crash(attempt: object) -> Response:
        raise RuntimeError("provider exploded")

    idem.run(intent("k1"), lambda attempt: Response.json(503, {"title": "down"}))
    with pytest.raises(RuntimeError):
        idem.run(intent("k1"), crash)
    samples = scrape()
    assert outcome(samples, "released") == 2
    assert outcome(samples, "claimed") == 2
    assert outcome(samples, "completed") == 0


def test_an_unreachable_store_increments_store_unavailable(
    tmp_path: Path, table_name: str, metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """A key store locked by another writer is an outage: counted, and the run fails closed."""
    path = tmp_path / "keys.db"
    SQLiteStore(path, table=table_name).migrate()
    store = SQLiteStore(path, table=table_name, busy_timeout=0.05)
    idem = Idempotency(store, Policy(request_timeout=30), observer=metrics)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable):
            idem.run(intent("k1"), created)
    finally:
        blocker.close()
    samples = scrape()
    assert outcome(samples, "store_unavailable") == 1
    assert outcome(samples, "claimed") == 0


def test_an_unknown_outcome_is_counted_and_its_key_is_not_released(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """OutcomeUnknown keeps the claim: counted as outcome_unknown, never as released, and
    the retry that finds the key held is an in_progress_conflict."""

    def timed_out(attempt: object) -> Response:
        raise OutcomeUnknown("the provider did not answer")

    with pytest.raises(OutcomeUnknown):
        idem.run(intent("k1"), timed_out)
    with pytest.raises(InProgress):
        idem.run(intent("k1"), created)
    samples = scrape()
    assert outcome(samples, "outcome_unknown") == 1
    assert outcome(samples, "released") == 0
    assert outcome(samples, "in_progress_conflict") == 1


def test_an_intent_without_endpoint_is_counted_under_unknown(
    idem: Idempotency, scrape: Callable[[], Samples]
) -> None:
    """An empty endpoint never becomes an empty label value."""
    idem.run(intent("k1", endpoint=""), created)
    assert outcome(scrape(), "claimed", endpoint="unknown") == 1


# --- the stuck-claims gauge -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_gauge_counts_claims_older_than_the_request_timeout(
    kind: str, tmp_path: Path, table_name: str, metrics: PrometheusMetrics
) -> None:
    """in_progress records untouched past the timeout count; fresh and settled ones do not."""
    clock = FrozenClock(START)
    with (
        open_store(kind, tmp_path, table_name) as store,
        metrics_endpoint(metrics.registry) as scrape,
    ):
        metrics.watch_stale_claims(store, 30, cache_seconds=0, clock=clock)
        crash_after_claim(store, "old-1", at=START - 600)
        crash_after_claim(store, "old-2", at=START - 31)
        crash_after_claim(store, "fresh", at=START - 5)
        Idempotency(store, Policy(), clock=FrozenClock(START - 900)).run(intent("done"), created)
        samples = scrape()
        assert value(samples, "idemflow_stale_in_progress", state="in_progress") == 2
        assert value(samples, "idemflow_stale_in_progress", state="stale") == 0

        clock.advance(30)  # "fresh" is now 35 s old
        assert value(scrape(), "idemflow_stale_in_progress", state="in_progress") == 3


def test_the_gauge_counts_swept_but_unresolved_claims_as_stale(
    store: SQLiteStore, metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """A claim the sweeper marked and could not resolve stays visible, whatever its age."""
    crash_after_claim(store, "old", at=START - 600)
    store.sweep(State.IN_PROGRESS, START - 70, START, START + 86_400, 10)
    metrics.watch_stale_claims(store, 30, cache_seconds=0, clock=FrozenClock(START))
    samples = scrape()
    assert value(samples, "idemflow_stale_in_progress", state="stale") == 1
    assert value(samples, "idemflow_stale_in_progress", state="in_progress") == 0


def test_the_gauge_reuses_its_count_for_the_cache_period(
    store: SQLiteStore, metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """Scrapes within cache_seconds reuse one query; after it, the store is asked again."""
    clock = FrozenClock(START)
    metrics.watch_stale_claims(store, 30, cache_seconds=5, clock=clock)
    crash_after_claim(store, "a", at=START - 600)
    assert value(scrape(), "idemflow_stale_in_progress", state="in_progress") == 1
    crash_after_claim(store, "b", at=START - 600)
    clock.advance(4)
    assert value(scrape(), "idemflow_stale_in_progress", state="in_progress") == 1
    clock.advance(2)
    assert value(scrape(), "idemflow_stale_in_progress", state="in_progress") == 2


def test_a_failing_gauge_query_drops_the_sample_not_the_scrape(
    tmp_path: Path, metrics: PrometheusMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    """Without its table the gauge is left out, the other metrics are still served."""
    unmigrated = SQLiteStore(tmp_path / "empty.db", table="never_migrated")
    metrics.watch_stale_claims(unmigrated, 30, cache_seconds=0)
    metrics(Event.CLAIMED, intent("k"), 0.001)
    with metrics_endpoint(metrics.registry) as scrape, caplog.at_level(logging.WARNING):
        samples = scrape()
    assert not any(name == "idemflow_stale_in_progress" for name, _ in samples)
    assert outcome(samples, "claimed") == 1
    assert "could not count stuck claims in never_migrated" in caplog.text


# --- the sweeper's resolutions --------------------------------------------------------


def test_the_sweeper_counts_each_reclaimed_claim_once_by_resolution(
    store: SQLiteStore, metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """A swept crash is one stale_reclaimed request and one released resolution."""
    from idemflow.sweeper import Sweeper

    crash_after_claim(store, "crashed", at=START - 600)
    logs = LoggingObserver(logging.getLogger("test.sweeper"))
    sweeper = Sweeper(
        store, Policy(request_timeout=30), clock=FrozenClock(START), observer=fan_out(metrics, logs)
    )
    sweeper.sweep_once()
    samples = scrape()
    assert outcome(samples, "stale_reclaimed") == 1
    assert value(samples, "idemflow_stale_reclaimed_total", resolution="released") == 1
    assert value(samples, "idemflow_stale_reclaimed_total", resolution="completed") == 0


def test_every_resolution_is_exported_from_the_start(scrape: Callable[[], Samples]) -> None:
    """rate() works from the first scrape: each resolution is present at zero."""
    samples = scrape()
    for resolution in ("completed", "released", "unknown"):
        assert ("idemflow_stale_reclaimed_total", (("resolution", resolution),)) in samples


def test_a_custom_namespace_prefixes_every_metric(tmp_path: Path, table_name: str) -> None:
    """namespace= renames the whole family, and count() still reads it."""
    metrics = PrometheusMetrics(namespace="payments")
    store = SQLiteStore(tmp_path / "keys.db", table=table_name)
    store.migrate()
    Idempotency(store, observer=metrics).run(intent("k1"), created)
    metrics.watch_stale_claims(store, 30)
    assert metrics.count(Event.CLAIMED, ENDPOINT) == 1
    with metrics_endpoint(metrics.registry) as scrape:
        names = {name for name, _ in scrape()}
    assert "payments_requests_total" in names
    assert "payments_stale_in_progress" in names
    assert not any(name.startswith("idemflow_") for name in names)


@pytest.mark.postgres
def test_the_gauge_query_reads_the_state_age_index(tmp_path: Path, table_name: str) -> None:
    """EXPLAIN on 20 000 analysed rows: two ranges of an index led by the state
    (<table>_state_updated, or the sweeper's <table>_state_stale), no table scan."""
    import psycopg

    from idemflow.stores.sql import SQLStats
    from tests.conftest import POSTGRES_URL

    with (
        open_store("postgres", tmp_path, table_name) as store,
        psycopg.connect(POSTGRES_URL, autocommit=True) as conn,
    ):
        conn.execute(
            f"INSERT INTO {table_name} (principal, idempotency_key, fingerprint, endpoint, "
            "state, created_at, updated_at, expires_at) "
            "SELECT 'p', 'k' || g, 'f', 'e', 'completed', g, g, g FROM generate_series(1, 20000) g"
        )
        conn.execute(f"ANALYZE {table_name}")
        stats = store.stats()
        assert isinstance(stats, SQLStats)
        stuck = stats._stuck
        rows = conn.execute("EXPLAIN " + stuck.pyformat, stuck.bind({"cutoff": 500})).fetchall()
    plan = "\n".join(row[0] for row in rows)
    assert re.search(rf"Index Scan on {table_name}_state_(updated|stale)\b", plan), plan
    assert "Seq Scan" not in plan, plan
