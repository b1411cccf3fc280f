"""
Per-route policies through the driver: each run's own retention and request timeout
(``run(policy=…)``), beside the app's policy the sweeper runs on.

Each record carries its own retention (``expires_at``, set from the route's policy when
it settles), so one purge honours every route's, and its own stale threshold (``stale_at``,
set from the route's policy when it is claimed), so one sweeper on the app's policy ends
each route's crashed claims at the route's threshold, shorter or longer than the app's. The
doors: tests/http/test_route_policies.py and tests/integrations/test_route_policies.py;
every backend: tests/stores/test_contract.py.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from idemflow import Attempt, Idempotency, InProgress, LeaseLost, Policy, Response, State
from idemflow.stores.memory import MemoryStore
from idemflow.sweeper import Sweeper
from idemflow.testing import FrozenClock
from tests.factories import CREATED_AT as CREATED
from tests.factories import intent

APP = Policy(request_timeout=30, retention=timedelta(days=1))
#: A route whose requests are quick and whose outcomes are kept a week.
QUICK_KEPT_LONG = Policy(request_timeout=5, retention=timedelta(days=7))
#: A route whose requests may run twice the app's timeout (stale after 130 s, the app's 70 s).
SLOW = Policy(request_timeout=60)


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


def test_a_slower_route_than_the_app_runs_past_the_apps_threshold_and_is_swept_at_its_own(
    clock: FrozenClock,
) -> None:
    """A route with a longer request timeout than the app's is accepted: its claim carries
    its own threshold, so the app's sweeper leaves it alone past the app's threshold (the
    request completes) and ends it only once its own has passed (the owner then cannot)."""
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    sweeper = Sweeper(store, APP, clock=clock)
    assert SLOW.stale_seconds > APP.stale_seconds
    released: list[int] = []

    def runs_past(seconds: float) -> Callable[[Attempt], Response]:
        def handler(attempt: Attempt) -> Response:
            clock.advance(seconds)
            released.append(sweeper.sweep_once().released)
            return CREATED

        return handler

    outcome = idem.run(intent("slow"), runs_past(APP.stale_seconds + 1), policy=SLOW)

    assert (outcome.replayed, outcome.response, released) == (False, CREATED, [0])
    assert (record := store.get("alice", "slow")) is not None
    assert record.state is State.COMPLETED
    with pytest.raises(LeaseLost):  # a request hung past its own threshold: swept, fenced
        idem.run(intent("hung"), runs_past(SLOW.stale_seconds + 1), policy=SLOW)
    assert released == [0, 1]


def test_the_handler_sees_the_policy_it_runs_under(clock: FrozenClock) -> None:
    """The route's retention, timeout and stale threshold: the one its claim carries and is
    swept at (what a 409's Retry-After is dated by)."""
    idem = Idempotency(MemoryStore(), APP, clock=clock)
    seen: list[Policy] = []

    def handler(attempt: Attempt) -> Response:
        seen.append(attempt.policy)
        return CREATED

    claimed = idem.run(intent("route"), handler, policy=QUICK_KEPT_LONG).record
    idem.run(intent("app"), handler)

    route, app = seen
    assert app is APP
    assert (route.request_timeout, route.retention) == (
        QUICK_KEPT_LONG.request_timeout,
        QUICK_KEPT_LONG.retention,
    )
    assert route.stale_after == QUICK_KEPT_LONG.stale_after
    assert claimed.stale_at == claimed.created_at + QUICK_KEPT_LONG.stale_seconds


def test_a_sweeper_on_the_app_policy_ends_each_routes_crashed_claim_at_its_own_threshold(
    clock: FrozenClock,
) -> None:
    """Three routes, 5 s, 30 s and 60 s timeouts, each with a claim its crashed process left:
    each is ended once its own threshold (20 s, 70 s, 130 s) has passed, none before."""
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    sweeper = Sweeper(store, APP, clock=clock)
    routes = {"quick": QUICK_KEPT_LONG, "app": APP, "slow": SLOW}
    for key, policy in routes.items():  # what the driver's claim writes, its process then killed
        claim = store.claim(
            intent(key), f"lease-{key}", clock(), clock() + 60, stale_after=policy.stale_seconds
        )
        assert claim.owned
    started = clock()

    for key, policy in routes.items():
        clock.advance(started + policy.stale_seconds - 1 - clock())
        assert sweeper.sweep_once().released == 0
        assert (record := store.get("alice", key)) is not None
        assert record.state is State.IN_PROGRESS
        clock.advance(2)
        assert sweeper.sweep_once().released == 1
    assert idem.run(intent("quick"), created, policy=QUICK_KEPT_LONG).replayed is False


def test_a_409_on_a_slower_routes_orphaned_claim_waits_for_its_own_threshold(
    clock: FrozenClock,
) -> None:
    """Past the app's 70 s threshold a slow route's crashed claim is still there (swept at its
    own 130 s): the Retry-After says so, whichever route the retry comes through."""
    store = MemoryStore()
    idem = Idempotency(store, APP, clock=clock)
    claim = store.claim(
        intent(), "lease-crashed", clock(), clock() + 60, stale_after=SLOW.stale_seconds
    )
    assert claim.owned
    clock.advance(APP.stale_seconds + 1)

    for policy in (SLOW, APP):
        with pytest.raises(InProgress) as busy:
            idem.run(intent(), created, policy=policy)
        assert busy.value.retry_after >= SLOW.stale_seconds - APP.stale_seconds - 1


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
