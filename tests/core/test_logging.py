"""
Logs through the standard logging module: structured fields, quiet normal paths,
and never the key itself. Runs go through a real SQLite store.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from idemflow import (
    Attempt,
    Event,
    Idempotency,
    InProgress,
    KeyReused,
    LeaseLost,
    Policy,
    Response,
    StoreUnavailable,
    fan_out,
)
from idemflow._events import CountingObserver, null_observer
from idemflow.logs import LoggingObserver, key_digest
from idemflow.stores.sqlite import SQLiteStore
from idemflow.testing import FrozenClock
from tests.ops_support import created, intent

SECRET_KEY = "key-7f3a9c0e-do-not-log"
LOGGER = "idemflow.events"


@pytest.fixture
def store(tmp_path: Path, table_name: str) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "keys.db", table=table_name)
    store.migrate()
    return store


@pytest.fixture
def idem(store: SQLiteStore) -> Idempotency:
    return Idempotency(store, Policy(request_timeout=30), observer=LoggingObserver())


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    return [(r.outcome, r.levelno) for r in caplog.records if r.name == LOGGER]  # type: ignore[attr-defined]


def test_the_normal_paths_are_silent_at_info(
    idem: Idempotency, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim, its completion and a replay log nothing at INFO."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        idem.run(intent(SECRET_KEY), created)
        idem.run(intent(SECRET_KEY), created)
    assert events(caplog) == []


def test_the_normal_paths_log_at_debug(idem: Idempotency, caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG every event is there, in order."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        idem.run(intent(SECRET_KEY), created)
        idem.run(intent(SECRET_KEY), created)
    assert events(caplog) == [
        ("claimed", logging.DEBUG),
        ("completed", logging.DEBUG),
        ("replayed", logging.DEBUG),
    ]


def test_conflicts_mismatches_and_releases_log_at_info(
    idem: Idempotency, caplog: pytest.LogCaptureFixture
) -> None:
    """409s, 422s and released claims are worth a line at INFO."""

    def first(attempt: Attempt) -> Response:
        with pytest.raises(InProgress):
            idem.run(intent(SECRET_KEY), created)
        return Response.json(503, {"title": "provider down"})

    with caplog.at_level(logging.INFO, logger=LOGGER):
        idem.run(intent(SECRET_KEY), first)
        idem.run(intent(SECRET_KEY), created)
        with pytest.raises(KeyReused):
            idem.run(intent(SECRET_KEY, body=b"{}"), created)
    assert events(caplog) == [
        ("in_progress_conflict", logging.INFO),
        ("released", logging.INFO),
        ("fingerprint_mismatch", logging.INFO),
    ]


def test_outages_and_lost_leases_log_at_warning(
    tmp_path: Path, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A locked store and a claim taken over before completion are warnings."""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, table=table_name, busy_timeout=0.05)
    store.migrate()
    idem = Idempotency(store, observer=LoggingObserver())

    def overrun(attempt: Attempt) -> Response:
        store.release(attempt.record, 0)  # as if the sweeper had taken it meanwhile
        return created(attempt)

    blocker = sqlite3.connect(path, isolation_level=None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(LeaseLost):
            idem.run(intent("k1"), overrun)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(StoreUnavailable):
                idem.run(intent("k2"), created)
        finally:
            blocker.close()
    assert events(caplog) == [
        ("lease_lost", logging.WARNING),
        ("store_unavailable", logging.WARNING),
    ]


def test_each_line_carries_structured_fields_and_never_the_key(
    idem: Idempotency, caplog: pytest.LogCaptureFixture
) -> None:
    """outcome, endpoint, principal, key digest, correlation id, elapsed: the key is nowhere."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        idem.run(intent(SECRET_KEY, correlation_id="req-42"), created)
        with pytest.raises(KeyReused):
            idem.run(intent(SECRET_KEY, body=b"{}", correlation_id="req-43"), created)
    mismatch = [r for r in caplog.records if r.name == LOGGER][-1]
    fields = vars(mismatch)
    assert fields["outcome"] == "fingerprint_mismatch"
    assert fields["endpoint"] == "POST /payments"
    assert fields["principal"] == "alice"
    assert fields["key_digest"] == key_digest("alice", SECRET_KEY)
    assert fields["correlation_id"] == "req-43"
    assert fields["elapsed_ms"] >= 0
    assert "POST /payments" in mismatch.getMessage()
    for record in caplog.records:
        rendered = record.getMessage() + json.dumps(vars(record), default=str)
        assert SECRET_KEY not in rendered


def test_the_key_digest_is_short_stable_and_scoped() -> None:
    """16 hex digits; the same for the same pair, different per principal and per salt."""
    digest = key_digest("alice", SECRET_KEY)
    assert len(digest) == 16
    int(digest, 16)
    assert digest == key_digest("alice", SECRET_KEY)
    assert digest != key_digest("bob", SECRET_KEY)
    assert digest != key_digest("alice", SECRET_KEY, salt=b"secret")
    assert key_digest("al", "ice\0k") != key_digest("al\0ice", "k")


def test_levels_can_be_changed_per_event(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An app that wants every replay at INFO says so."""
    logger = logging.getLogger("app.idempotency")
    observer = LoggingObserver(logger, levels={Event.REPLAYED: logging.INFO})
    idem = Idempotency(store, observer=observer)
    with caplog.at_level(logging.INFO, logger="app.idempotency"):
        idem.run(intent("k1"), created)
        idem.run(intent("k1"), created)
    assert [r.outcome for r in caplog.records] == ["replayed"]  # type: ignore[attr-defined]


def test_fan_out_tells_every_observer_even_when_one_fails(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken observer is logged and skipped: the request and the other observers go on."""

    def broken(event: Event, intent: object, elapsed: float) -> None:
        raise RuntimeError("exporter down")

    counter = CountingObserver()
    idem = Idempotency(store, clock=FrozenClock(), observer=fan_out(broken, counter))
    with caplog.at_level(logging.ERROR, logger="idemflow"):
        outcome = idem.run(intent("k1"), created)
    assert outcome.response.status == 201
    assert counter.total(Event.CLAIMED) == 1
    assert counter.total(Event.COMPLETED) == 1
    failures = [r for r in caplog.records if r.name == "idemflow"]
    assert [r.getMessage().rsplit(" ", 1)[-1] for r in failures] == ["claimed", "completed"]


def test_fan_out_of_one_is_that_observer() -> None:
    """No wrapper, no overhead, when there is nothing to combine."""
    counter = CountingObserver()
    assert fan_out(counter) is counter


def test_fan_out_leaves_out_the_null_observer() -> None:
    """A driver without an observer of its own, traced: one observer to call, not two
    (and none at all when nobody listens: the driver then reads no clock either)."""
    counter = CountingObserver()
    assert fan_out(null_observer, counter) is counter
    assert fan_out(null_observer) is null_observer
