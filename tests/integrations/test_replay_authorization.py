"""
Replay authorization through every Django and Flask door (guarantee 6: "authorization
re-checked on replay"), in process, on raw WSGI environs (test_wsgi_doors.py's doors).

A replay is answered from the stored response without running the view, so without its
permission checks; in Django's middleware mode before the view's decorators too. The
hook (``IDEMFLOW["authorize_replay"]``, ``@idempotent(authorize_replay=…)``,
``Idempotency(authorize_replay=…)``, ``IDEMFLOW_AUTHORIZE_REPLAY``,
``@idem.protect(authorize_replay=…)``) is asked with the stored record before each
replay and only then: False is the 403 ``replay-forbidden`` problem, without the stored
body, the view not run, the record untouched; True again is the byte-identical replay.
The key records are real: SQLite (and PostgreSQL for the doors inside the request's
transaction).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("django")
pytest.importorskip("rest_framework")
pytest.importorskip("flask")

from idemflow import ConfigurationError, Record, State
from tests.http.conftest import assert_problem
from tests.integrations.test_wsgi_doors import (
    _DJANGO_DOORS,
    BODY,
    Door,
    Stream,
    _django_door,
    _flask_door,
    environ,
    who,
)

#: How long a test waits for a request running in another thread.
WAIT = 30.0


class Gate:
    """A replay hook whose answer the test sets; it keeps every record it was asked about."""

    def __init__(self) -> None:
        self.allow = True
        self.asked: list[Record] = []

    def __call__(self, record: Record) -> bool:
        self.asked.append(record)
        return self.allow

    def of(self, principal: str) -> list[Record]:
        return [record for record in self.asked if record.principal == principal]


#: Hooks the doors name by their import path (``IDEMFLOW["authorize_replay"]``,
#: ``IDEMFLOW_AUTHORIZE_REPLAY`` as strings).
SETTINGS_GATE = Gate()
CONFIG_GATE = Gate()
_HERE = __name__


async def _async_hook(record: Record) -> bool:
    return True


#: Typed Any: mypy already refuses it where a hook is a parameter; given at run time anyway.
async_hook: Any = _async_hook


class Runs(list[str]):
    """The principals a door's view ran for. After ``hold(principal)`` that principal's
    next run waits inside the view until the returned ``go`` is set: a first request
    still in flight, its claim taken."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[str, tuple[threading.Event, threading.Event]] = {}

    def hold(self, principal: str) -> tuple[threading.Event, threading.Event]:
        """``(entered, go)``: set when the view is running; set it to let the view end."""
        gates = self._held[principal] = (threading.Event(), threading.Event())
        return gates

    def append(self, principal: str) -> None:
        super().append(principal)
        gates = self._held.pop(principal, None)
        if gates is not None:
            entered, go = gates
            entered.set()
            go.wait(WAIT)


@dataclass(frozen=True)
class Hooked:
    """A door whose replays ``gate`` decides; ``overridden``: a hook the view's own one
    replaces, never to be asked."""

    door: Door
    runs: Runs
    gate: Gate
    overridden: Gate | None = None


# name: (door, what sets the hook). "setting": the app-wide hook; "view": the view's own
# hook, with an app-wide one it replaces; "path": the app-wide hook by its import path.
_HOOKED = {
    "flask": ("flask", "setting"),
    "flask-config-path": ("flask", "path"),
    "flask-view": ("flask", "view"),
    "django-function": ("django-function", "setting"),
    "django-function-path": ("django-function", "path"),
    "django-function-view": ("django-function", "view"),
    "django-cbv": ("django-cbv", "setting"),
    "django-cbv-view": ("django-cbv", "view"),
    "django-drf": ("django-drf", "setting"),
    "django-drf-view": ("django-drf", "view"),
    "django-middleware": ("django-middleware", "setting"),
    "django-middleware-path": ("django-middleware", "path"),
    # ATOMIC_REQUESTS on PostgreSQL: the method runs inside the request's transaction.
    "django-atomic-cbv": ("django-atomic-cbv", "setting"),
    "django-atomic-drf-view": ("django-atomic-drf", "view"),
}
HOOKED = [
    pytest.param(name, marks=pytest.mark.postgres) if "atomic" in name else name for name in _HOOKED
]


def _flask_options(how: str, gate: Gate, overridden: Gate | None) -> dict[str, Any]:
    if how == "setting":
        return {"extension": {"authorize_replay": gate}}
    if how == "path":
        return {"config": {"IDEMFLOW_AUTHORIZE_REPLAY": f"{_HERE}.CONFIG_GATE"}}
    return {"extension": {"authorize_replay": overridden}, "protect": {"authorize_replay": gate}}


def _django_options(how: str, gate: Gate, overridden: Gate | None) -> dict[str, Any]:
    if how == "setting":
        return {"settings": {"authorize_replay": gate}}
    if how == "path":
        return {"settings": {"authorize_replay": f"{_HERE}.SETTINGS_GATE"}}
    return {"settings": {"authorize_replay": overridden}, "decorator": {"authorize_replay": gate}}


@pytest.fixture(scope="module", params=HOOKED)
def hooked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hooked]:
    door_name, how = _HOOKED[request.param]
    runs = Runs()
    overridden = Gate() if how == "view" else None
    by_path = CONFIG_GATE if door_name == "flask" else SETTINGS_GATE
    gate = by_path if how == "path" else Gate()
    if door_name == "flask":
        tmp = tmp_path_factory.mktemp(request.param)
        made = _flask_door(tmp, runs, **_flask_options(how, gate, overridden))
    else:
        where = _DJANGO_DOORS[door_name]
        made = _django_door(door_name, *where, runs, **_django_options(how, gate, overridden))
    with made as door:
        yield Hooked(door, runs, gate, overridden)


def post(door: Door, principal: str, body: bytes = BODY) -> httpx.Response:
    """A POST of ``body`` with the key ``k-1``, as a server passes it on."""
    return door.call(environ(door.path, principal, (b"k-1",), Stream(body), length=str(len(body))))


def stored(door: Door, principal: str) -> Record:
    assert door.record is not None
    record = door.record(principal, "k-1")
    assert isinstance(record, Record)
    return record


def test_a_refused_replay_is_a_403_without_the_stored_body_and_leaves_the_record(
    hooked: Hooked,
) -> None:
    """First request: 201, stored, the hook not asked. The hook then says False: the
    retry is the 403 ``replay-forbidden`` problem, the stored body not in it, no
    ``Idempotent-Replayed``, the view not run again, the record as it was (completed,
    the same response); the hook was asked once, with that record. It says True again:
    the stored response byte for byte, with ``Idempotent-Replayed: true``. Before, the
    Django and Flask doors had no hook to set: every retry was replayed."""
    door, gate = hooked.door, hooked.gate
    alice = who()
    gate.allow = True

    first = post(door, alice)
    assert first.status_code == 201, first.text
    assert gate.of(alice) == []  # a first execution is not a replay
    kept = stored(door, alice)
    assert kept.state is State.COMPLETED

    gate.allow = False
    refused = post(door, alice)
    problem = assert_problem(refused, 403, "replay-forbidden")
    assert first.content not in refused.content
    assert "id" not in problem
    assert "idempotent-replayed" not in refused.headers
    assert door.ran.count(alice) == 1
    assert stored(door, alice) == kept
    assert gate.of(alice) == [kept]

    gate.allow = True
    again = post(door, alice)
    assert again.status_code == 201, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"]
    assert door.ran.count(alice) == 1
    assert len(gate.of(alice)) == 2
    if hooked.overridden is not None:  # the view's own hook replaced the app-wide one
        assert hooked.overridden.asked == []


def test_the_hook_is_asked_on_a_replay_only_never_on_a_409_or_a_422(hooked: Hooked) -> None:
    """With the hook saying False throughout (so an answer it was asked about would turn
    into a 403): a duplicate while the first request runs is the 409 ``in-progress``
    problem, the first one then answers 201, the same key with another body is the 422
    ``key-reused`` problem, and none of these asked the hook; the replay that follows
    asks it once and is refused."""
    door, gate = hooked.door, hooked.gate
    alice = who()
    gate.allow = False
    entered, go = hooked.runs.hold(alice)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, door, alice)
        try:
            assert entered.wait(WAIT), "the first request never reached the view"
            duplicate = post(door, alice)
        finally:
            go.set()
        first = running.result(WAIT)
    reused = post(door, alice, b'{"amount": 11}')
    asked_before_the_replay = gate.of(alice)
    replay = post(door, alice)

    assert_problem(duplicate, 409, "in-progress")
    assert first.status_code == 201, first.text
    assert_problem(reused, 422, "key-reused")
    assert asked_before_the_replay == []
    assert_problem(replay, 403, "replay-forbidden")
    assert [record.principal for record in gate.of(alice)] == [alice]
    assert door.ran.count(alice) == 1


# --- a hook the sync edge cannot run is refused where it is configured ------------------------


def test_flask_refuses_an_async_hook_when_the_app_is_set_up() -> None:
    """The sync edge cannot await: ``Idempotency(authorize_replay=…)``,
    ``IDEMFLOW_AUTHORIZE_REPLAY`` (a callable or its import path) and
    ``@idem.protect(authorize_replay=…)`` refuse an ``async def`` hook with a
    ConfigurationError naming where it was set, instead of a 500 on every replay; a hook
    given both ways is refused too."""
    from flask import Flask

    from idemflow.integrations.flask import Idempotency
    from idemflow.stores.sqlite import SQLiteStore

    def app_with(**config: Any) -> Flask:
        app = Flask(__name__)
        app.config.update(config)
        return app

    with pytest.raises(ConfigurationError, match=r"Idempotency\(authorize_replay=…\).*coroutine"):
        Idempotency(principal=lambda: "alice", authorize_replay=async_hook)
    store = SQLiteStore(":memory:")
    try:
        for setting in (async_hook, f"{_HERE}.async_hook"):
            idem = Idempotency(store=store, principal=lambda: "alice")
            with pytest.raises(ConfigurationError, match=r"IDEMFLOW_AUTHORIZE_REPLAY.*coroutine"):
                idem.init_app(app_with(IDEMFLOW_AUTHORIZE_REPLAY=setting))
        idem = Idempotency(store=store, principal=lambda: "alice", authorize_replay=Gate())
        with pytest.raises(ConfigurationError, match="not both"):
            idem.init_app(app_with(IDEMFLOW_AUTHORIZE_REPLAY=Gate()))
        with pytest.raises(ConfigurationError, match=r"protect\(authorize_replay=…\).*coroutine"):
            idem.protect(authorize_replay=async_hook)
    finally:
        store.close()


def test_django_refuses_an_async_hook_in_the_settings_at_start_up_and_in_the_decorator() -> None:
    """``IDEMFLOW["authorize_replay"]`` as an ``async def`` callable is an
    ImproperlyConfigured when the settings are checked (``AppConfig.ready``); as the
    import path of one, ``IdempotencyMiddleware`` refuses to start, and a decorated
    view answers the 500 problem naming the setting, the view not run;
    ``@idempotent(authorize_replay=…)`` refuses one when it decorates."""
    from django.core.exceptions import ImproperlyConfigured
    from django.http import HttpResponse
    from django.test import RequestFactory, override_settings

    from idemflow.integrations.django import IdempotencyMiddleware, idempotent
    from idemflow.integrations.django.conf import idemflow_settings

    principal = {"principal": lambda request: "alice"}
    with (
        override_settings(IDEMFLOW={**principal, "authorize_replay": async_hook}),
        pytest.raises(ImproperlyConfigured, match=r"\['authorize_replay'\].*coroutine"),
    ):
        idemflow_settings()

    ran: list[str] = []

    def view(request: Any) -> HttpResponse:
        ran.append("view")
        return HttpResponse(status=201)

    path = f"{_HERE}.async_hook"
    with override_settings(IDEMFLOW={**principal, "authorize_replay": path}):
        with pytest.raises(ImproperlyConfigured, match=r"\['authorize_replay'\].*coroutine"):
            IdempotencyMiddleware(view)
        request = RequestFactory().post(
            "/payments", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-1"
        )
        answer = idempotent(view)(request)
    assert answer.status_code == 500
    assert "['authorize_replay'] is a coroutine function" in answer.content.decode()
    assert ran == []

    with pytest.raises(ConfigurationError, match=r"@idempotent\(authorize_replay=…\).*coroutine"):
        idempotent(authorize_replay=async_hook)


#: A Django project starting (``django.setup()``, so ``AppConfig.ready``) with
#: ``IDEMFLOW[sys.argv[1]]`` set to ``sys.argv[2]``; says whether the path's module was
#: imported by then.
_START = """
import sys
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth",
                    "idemflow.integrations.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    IDEMFLOW={sys.argv[1]: sys.argv[2]},
)
django.setup()
print("imported" if "tests.integrations.replay_hook_views" in sys.modules else "not imported")
"""
_ROOT = Path(__file__).resolve().parents[2]
_VIEWS = "tests.integrations.replay_hook_views"


def start_django(path: str, setting: str = "authorize_replay") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _START, setting, path]
    return subprocess.run(
        command, cwd=_ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_django_imports_the_hooks_path_at_start_up_even_from_a_module_of_its_views() -> None:
    """``IDEMFLOW["authorize_replay"]`` as a path is imported when the project starts
    (``AppConfig.ready``), so a wrong one fails the start: an ``async def`` hook or a
    name the module lacks is an ImproperlyConfigured there, not a 500 on every protected
    request. It is imported once the settings' lock is free: a module that holds
    ``@idempotent`` views next to the hook (decorating reads the settings) would
    otherwise wait on that lock for ever (the start would hang: a timeout here)."""
    started = start_django(f"{_VIEWS}.may_replay")
    assert started.returncode == 0, started.stderr
    assert started.stdout.split() == ["imported"]

    for wrong, said in (("may_replay_later", "coroutine"), ("nowhere", "nowhere")):
        refused = start_django(f"{_VIEWS}.{wrong}")
        assert refused.returncode != 0
        assert "ImproperlyConfigured" in refused.stderr, refused.stderr
        assert "['authorize_replay']" in refused.stderr
        assert said in refused.stderr


def test_django_imports_the_observers_path_at_start_up_even_from_a_module_of_its_views() -> None:
    """``IDEMFLOW["observer"]`` as a path, the same way: imported when the project starts,
    outside the settings' lock (a views module holding the metrics would hang the start),
    and a wrong name is an ImproperlyConfigured there."""
    started = start_django(f"{_VIEWS}.COUNTED", "observer")
    assert started.returncode == 0, started.stderr
    assert started.stdout.split() == ["imported"]

    refused = start_django(f"{_VIEWS}.nowhere", "observer")
    assert refused.returncode != 0
    assert "ImproperlyConfigured" in refused.stderr, refused.stderr
    assert "['observer']" in refused.stderr
