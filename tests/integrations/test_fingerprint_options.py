"""
The fingerprint's options through the Django and Flask doors, in process, on raw WSGI
environs (test_wsgi_doors.py's doors): ``exclude_fields`` (``IDEMFLOW["exclude_fields"]``,
``IDEMFLOW_EXCLUDE_FIELDS``) leaves per-attempt JSON members out of the fingerprint, so a
retry that changes only them is a replay, while any other change is still a 422;
``strict_key`` (``IDEMFLOW["strict_key"]``, ``IDEMFLOW_STRICT_KEY``) accepts the key only
in its quoted sf-string form. A string where a list of names belongs is refused at
start-up, never read as its letters.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("django")
pytest.importorskip("rest_framework")
pytest.importorskip("flask")

from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from idemflow import ConfigurationError
from idemflow.integrations.django.conf import idemflow_settings
from tests.http.conftest import assert_problem
from tests.integrations.test_wsgi_doors import (
    _DJANGO_DOORS,
    Door,
    Stream,
    _django_door,
    _flask_door,
    environ,
    who,
)

#: The doors, each on SQLite: Flask's extension, and Django's function view and middleware.
DOORS = ["flask", "django-function", "django-middleware"]


@contextlib.contextmanager
def door_with(name: str, tmp: Path, **options: Any) -> Iterator[Door]:
    """Door ``name`` with ``options`` set the framework's way (``app.config`` upper-case)."""
    if name == "flask":
        config = {f"IDEMFLOW_{option.upper()}": value for option, value in options.items()}
        with _flask_door(tmp, config=config) as door:
            yield door
        return
    with _django_door(name, *_DJANGO_DOORS[name], settings=options) as door:
        yield door


def post(door: Door, principal: str, body: dict[str, Any], key: bytes = b"k-1") -> httpx.Response:
    raw = json.dumps(body).encode()
    return door.call(environ(door.path, principal, (key,), Stream(raw), length=str(len(raw))))


@pytest.mark.parametrize("name", DOORS)
def test_excluded_fields_change_nothing_and_every_other_change_is_a_422(
    name: str, tmp_path: Path
) -> None:
    alice = who()
    with door_with(name, tmp_path, exclude_fields=["nonce", "sent_at"]) as door:
        first = post(door, alice, {"amount": 10, "nonce": "a", "sent_at": 1})
        retried = post(door, alice, {"amount": 10, "nonce": "b", "sent_at": 2})
        changed = post(door, alice, {"amount": 11, "nonce": "a", "sent_at": 1})

    assert first.status_code == 201, first.text
    assert (retried.status_code, retried.headers.get("idempotent-replayed")) == (201, "true")
    assert retried.content == first.content
    assert_problem(changed, 422, "key-reused")
    assert door.ran == [alice]


@pytest.mark.parametrize("name", DOORS)
def test_without_exclude_fields_a_changed_nonce_is_a_422(name: str, tmp_path: Path) -> None:
    """The control: the same two requests without the option."""
    alice = who()
    with door_with(name, tmp_path) as door:
        first = post(door, alice, {"amount": 10, "nonce": "a"})
        retried = post(door, alice, {"amount": 10, "nonce": "b"})

    assert first.status_code == 201, first.text
    assert_problem(retried, 422, "key-reused")


@pytest.mark.parametrize("name", DOORS)
def test_a_strict_key_is_only_the_quoted_form(name: str, tmp_path: Path) -> None:
    alice, bob = who(), who()
    with door_with(name, tmp_path, strict_key=True) as door:
        bare = post(door, alice, {"amount": 10}, key=b"k-1")
        quoted = post(door, bob, {"amount": 10}, key=b'"k-1"')
        claimed = door.records(alice), door.records(bob)

    assert_problem(bare, 400, "invalid-key")
    assert quoted.status_code == 201, quoted.text
    assert door.ran == [bob]
    assert claimed == (0, 1)


def test_a_string_of_excluded_fields_is_refused_at_start_up(tmp_path: Path) -> None:
    with (
        pytest.raises(ConfigurationError, match="IDEMFLOW_EXCLUDE_FIELDS"),
        door_with("flask", tmp_path, exclude_fields="nonce"),
    ):
        pass
    with (
        override_settings(IDEMFLOW={"exclude_fields": "nonce"}),
        pytest.raises(ImproperlyConfigured, match="exclude_fields"),
    ):
        idemflow_settings()
