"""
A route's own policy on every WSGI door, in each framework's idiom (test_wsgi_doors.py's
doors): the WSGI middleware's endpoint table (``{"POST /payments": Policy(…)}``),
Flask's ``@idem.protect(policy=…)``, Django's ``@idempotent(policy=…)`` on a function
view, a class-based view and a DRF action, and ``IDEMFLOW["endpoints"]`` as a dict for
Django's middleware. The stored record carries the route's retention (its ``expires_at``,
counted from settlement) and its own stale threshold (its ``stale_at``, from its claim), a
longer one than the app's too; a resolver picks a policy per principal.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")
pytest.importorskip("rest_framework")
pytest.importorskip("flask")

from idemflow import Policy
from tests.integrations.test_wsgi_doors import (
    _DJANGO_DOORS,
    BODY,
    DJANGO_DOORS,
    Door,
    Stream,
    _django_door,
    _flask_door,
    _wsgi_door,
    environ,
    who,
)

WEEK = timedelta(days=7)
#: Every door's app policy keeps outcomes a day (the defaults) with a 30 s timeout, or 5 s.
DAY = timedelta(days=1).total_seconds()
KEPT_A_WEEK = Policy(request_timeout=5, retention=WEEK)


def _door(name: str, tmp: Path, policy: Any) -> contextlib.AbstractContextManager[Door]:
    """``name``'s door with ``policy`` as its protected route's, in that framework's idiom."""
    if name == "wsgi":
        return _wsgi_door(tmp, {"POST /payments": policy})
    if name == "flask":
        return _flask_door(tmp, protect={"policy": policy})
    if name == "django-middleware":
        endpoints = {"POST /mw/payments": policy}
        return _django_door(name, *_DJANGO_DOORS[name], settings={"endpoints": endpoints})
    return _django_door(name, *_DJANGO_DOORS[name], decorator={"policy": policy})


@pytest.fixture(params=["wsgi", "flask", *DJANGO_DOORS])
def door_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _settle(door: Door, principal: str) -> Any:
    answer = door.call(environ(door.path, principal, stream=Stream(BODY)))
    assert answer.status_code == 201, answer.text
    record = door.record(principal, "k-1")  # type: ignore[misc]
    assert record is not None
    return record


def test_a_routes_retention_is_what_its_record_keeps(door_name: str, tmp_path: Path) -> None:
    """The route kept a week; its record expires a week after it settled (the app: a day)."""
    with _door(door_name, tmp_path, KEPT_A_WEEK) as door:
        record = _settle(door, who())
        kept = record.expires_at - record.updated_at
        assert kept == pytest.approx(WEEK.total_seconds(), abs=0.002)
        assert kept != pytest.approx(DAY, abs=1)


def test_a_resolver_gives_each_principal_its_policy(door_name: str, tmp_path: Path) -> None:
    """``(principal) -> Policy``: one route, a week for one customer, a minute for another."""
    vip, other = who(), who()
    minute = Policy(request_timeout=5, retention=60)

    def per_customer(principal: str) -> Policy:
        return KEPT_A_WEEK if principal == vip else minute

    with _door(door_name, tmp_path, per_customer) as door:
        kept = {p: _settle(door, p) for p in (vip, other)}
        assert {p: round(r.expires_at - r.updated_at) for p, r in kept.items()} == {
            vip: WEEK.total_seconds(),
            other: 60,
        }


def test_a_route_outliving_the_apps_stale_threshold_carries_its_own(
    door_name: str, tmp_path: Path
) -> None:
    """A 10-minute route under an app whose 30 s requests go stale after 70 s is accepted
    where it is configured: its record carries its own threshold (1210 s from its claim),
    the one the sweeper ends it at (tests/core/test_route_policies.py)."""
    slow = Policy(request_timeout=600)
    with _door(door_name, tmp_path, slow) as door:
        record = _settle(door, who())
        assert record.stale_at - record.created_at == pytest.approx(slow.stale_seconds, abs=1)
