"""
Per-route policies through the driver: each run's own retention and request timeout
(``run(policy=…)``), within the app's policy the sweeper runs on.

Each record carries its own retention (``expires_at``, set from the route's policy when
it settles), so one purge honours every route's; a route's stale threshold may be
shorter than the app's, never longer (one sweeper on the app's threshold must never end
a claim whose request can still run). The doors: tests/http/test_route_policies.py and
tests/integrations/test_route_policies.py; every backend: tests/stores/test_contract.py.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from idemflow import Attempt, ConfigurationError, Idempotency, InProgress, Policy, Response, State
from idemflow.stores.memory import MemoryStore
from idemflow.sweeper import Sweeper
from idemflow.testing import FrozenClock
from tests.factories import CREATED_AT as CREATED
from tests.factories import intent

APP = Policy(request_timeout=30, retention=timedelta(days=1))
#: A route whose requests are quick and whose outcomes are kept a week.
QUICK_KEPT_LONG = Policy(request_timeout=5, retention=timedelta(days=7))


def created(attempt: Attempt) -> Response:
    return CREATED


def test_each_run_keeps_its_outcome_for_its_own_routes_retention_and_purge_honours_both(
    clock: FrozenClock,
) -> None:
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)

    idem.run(intent("weekly"), created, policy=QUICK_KEPT_LONG)
    idem.run(intent("daily"), created)

    weekly, daily = store.get("alice", "weekly"), store.get("alice", "daily")
    assert weekly is not None
    assert daily is not None
    assert weekly.expires_at == clock() + timedelta(days=7).total_seconds()
    assert daily.expires_at == clock() + timedelta(days=1).total_seconds()
    clock.advance(timedelta(days=2))
    assert store.purge(clock(), 10) == 1
    assert store.get("alice", "daily") is None
    assert idem.run(intent("weekly"), created).replayed  # still within its own retention


def test_a_route_may_not_outlive_the_threshold_the_sweeper_runs_on(clock: FrozenClock) -> None:
    """A longer request timeout than the app's would be swept while it runs: refused."""
    idem = Idempotency(MemoryStore(), APP, clock=clock)
    slow = Policy(request_timeout=60)

    with pytest.raises(ConfigurationError, match="exceeds the app's"):
        idem.run(intent(), created, policy=slow)

    assert idem.store.get("alice", "k-1") is None  # refused before anything was claimed


def test_the_handler_sees_the_policy_it_runs_under(clock: FrozenClock) -> None:
    """The route's retention and timeout, and the app's stale threshold: the one its claim
    is swept at (what a 409's Retry-After is dated by)."""
    idem = Idempotency(MemoryStore(), APP, clock=clock)
    seen: list[Policy] = []

    def handler(attempt: Attempt) -> Response:
        seen.append(attempt.policy)
        return CREATED

    idem.run(intent("route"), handler, policy=QUICK_KEPT_LONG)
    idem.run(intent("app"), handler)

    route, app = seen
    assert app is APP
    assert (route.request_timeout, route.retention) == (
        QUICK_KEPT_LONG.request_timeout,
        QUICK_KEPT_LONG.retention,
    )
    assert route.stale_after == APP.stale_after


def test_a_sweeper_on_the_app_policy_never_ends_a_shorter_routes_claim_early(
    clock: FrozenClock,
) -> None:
    """Two routes, 5 s and 30 s timeouts, each with a claim its crashed process left: neither
    is ended before the app's threshold (70 s; the 5 s route's own is 20 s), both after it."""
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    sweeper = Sweeper(store, APP, clock=clock)
    assert QUICK_KEPT_LONG.stale_seconds < APP.stale_seconds
    for key in ("quick", "slow"):  # what the driver's claim writes, its process then killed
        assert store.claim(intent(key), f"lease-{key}", clock(), clock() + 60).owned
    clock.advance(APP.stale_seconds - 1)

    assert sweeper.sweep_once().released == 0
    left = [store.get("alice", key) for key in ("quick", "slow")]
    assert {None if r is None else r.state for r in left} == {State.IN_PROGRESS}
    clock.advance(2)
    assert sweeper.sweep_once().released == 2
    assert idem.run(intent("quick"), created, policy=QUICK_KEPT_LONG).replayed is False


def test_a_409_on_a_shorter_routes_orphaned_claim_waits_for_the_apps_sweeper(
    clock: FrozenClock,
) -> None:
    """Past the route's own 20 s threshold its crashed claim is still there (the sweeper
    ends it at the app's 70 s): the Retry-After says so, not "any moment now"."""
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    assert store.claim(intent(), "lease-crashed", clock(), clock() + 60).owned
    clock.advance(21)

    with pytest.raises(InProgress) as busy:
        idem.run(intent(), created, policy=QUICK_KEPT_LONG)

    assert busy.value.retry_after >= APP.stale_seconds - 21


class _TellingMemoryStore(MemoryStore):
    """A memory store that keeps the wait budgets its drivers tell it."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[float] = []

    def cover_store_wait(self, seconds: float) -> None:
        self.told.append(seconds)


def test_a_shorter_routes_wait_budget_is_told_to_the_store(clock: FrozenClock) -> None:
    """A 5 s route may wait on its store 2.5 s, not the app's 5 s: the store keeps the shortest."""
    store = _TellingMemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    assert store.told == [APP.store_wait_seconds]

    idem.run(intent(), created, policy=QUICK_KEPT_LONG)

    assert store.told == [APP.store_wait_seconds, QUICK_KEPT_LONG.store_wait_seconds]
    assert QUICK_KEPT_LONG.store_wait_seconds < APP.store_wait_seconds
