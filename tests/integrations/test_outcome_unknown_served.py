"""
``OutcomeUnknown`` through a framework's own error handling, in middleware mode, over
real servers on 127.0.0.1: Flask and Django (WSGI) behind the generic WSGI middleware
under gunicorn, Django (ASGI) and a whole FastAPI app behind the ASGI middleware under
uvicorn (``tests/integrations/outcome_unknown_apps.py``).

The view charged the provider, then raised ``OutcomeUnknown``. Flask and Django answer
that exception with a 500 of their own before the middleware sees it; a 500 alone is
transient and would release the key, and the retry would charge a second time. Their
error hooks (Flask's ``handle_outcome_unknown``, the Django app's ``got_request_exception``
receiver) report it through the slot the middleware leaves in the environ or scope: the
caller gets the 503 ``outcome-unknown`` problem, the key stays claimed (409 to the
retry, the charge ran once), and the sweeper's reconciler, asking the provider's
ledger, settles it into the replay. FastAPI re-raises after its ServerErrorMiddleware
sent its 500, so the ASGI middleware wrapped around the whole app sees the exception.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import Response, State
from idemflow.stores.sqlite import SQLiteStore
from idemflow.sweeper import DidNotHappen, Happened, Sweeper
from tests.integrations.outcome_unknown_apps import POLICY
from tests.integrations.test_outcome_unknown import assert_outcome_unknown
from tests.servers import serve_on_socket

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
APPS = "tests.integrations.outcome_unknown_apps"
SERVERS = {
    "flask-wsgi": ("gunicorn", "flask_app", "flask"),
    # handle_outcome_unknown(app) forgotten: before, Flask's 500 released and the retry
    # charged a second time; the middleware now needs no line to remember.
    "flask-wsgi-no-hook": ("gunicorn", "flask_app_without_the_hook", "flask"),
    "django-wsgi": ("gunicorn", "django_wsgi", "django"),
    "django-asgi": ("uvicorn", "django_asgi", "django"),
    "fastapi-asgi": ("uvicorn", "fastapi_outside", "fastapi"),
}


@contextlib.contextmanager
def server(kind: str, directory: Path) -> Iterator[str]:
    """The app under its real server, on a loopback socket bound here: its URL."""
    runner, factory, framework = SERVERS[kind]
    pytest.importorskip(framework)
    pytest.importorskip(runner)

    def command(fd: int) -> list[str]:
        if runner == "gunicorn":
            return [
                sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "4",
                "--bind", f"fd://{fd}", "--no-control-socket", "--graceful-timeout", "5",
                f"{APPS}:{factory}()",
            ]  # fmt: skip
        return [
            sys.executable, "-m", "uvicorn", "--factory", f"{APPS}:{factory}",
            "--fd", str(fd), "--lifespan", "off", "--log-level", "warning",
        ]  # fmt: skip

    log = directory / f"{kind}.log"
    env = {"OU_APP_DIR": str(directory)}
    with serve_on_socket(command, log, env=env, cwd=ROOT) as (url, _):
        yield url


def charges(directory: Path, key: str) -> int:
    path = directory / "provider.db"
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM charges WHERE key = ?", (key,)).fetchone()[0])


def pay(url: str, key: str, user: str) -> httpx.Response:
    headers = {"Idempotency-Key": key, "X-User": user, "Content-Type": "application/json"}
    return httpx.post(
        url + "/payments", content=b'{"amount": 1000}', headers=headers, timeout=30, verify=False
    )


@pytest.mark.parametrize("kind", list(SERVERS))
def test_a_framework_answered_outcome_unknown_keeps_the_claim(kind: str, tmp_path: Path) -> None:
    key, user = f"ou-{uuid.uuid4().hex}", "carol"
    with server(kind, tmp_path) as url:
        first = pay(url, key, user)
        retry = pay(url, key, user)
        charged = charges(tmp_path, key)
        store = SQLiteStore(tmp_path / "keys.db")
        try:
            held = store.get(user, key)

            def reconciler(record: Any, keys: Any) -> Any:
                """The provider's ledger says whether the charge went through."""
                if charges(tmp_path, record.key):
                    return Happened(Response.json(201, {"charged": record.key}))
                return DidNotHappen("no charge")

            # Past the stale threshold (SQLite: a one-host store on the caller's clock).
            later = time.time() + POLICY.stale_seconds + 1
            report = Sweeper(store, POLICY, reconciler=reconciler, clock=lambda: later).sweep_once()
            settled = store.get(user, key)
        finally:
            store.close()
        replay = pay(url, key, user)

    # The retry did not run the view again (without the slot: 500 twice, two charges).
    assert (first.status_code, retry.status_code, charged) == (503, 409, 1), retry.text
    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert report.completed == 1
    assert settled is not None
    assert settled.state is State.COMPLETED
    assert replay.status_code == 201, replay.text
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == {"charged": key}
    assert charges(tmp_path, key) == 1  # charged once, by the first request only
