"""
Apps whose framework answers a view's ``OutcomeUnknown`` itself, behind idemflow's
generic middleware, for tests/integrations/test_outcome_unknown_served.py.

``POST /payments`` charges the provider (a row in the provider's ledger, committed at
once: the provider is another system) and then cannot tell whether the charge went
through: it raises ``OutcomeUnknown``. Flask and Django answer that exception with a
500 of their own before the middleware sees it; FastAPI re-raises it after its
``ServerErrorMiddleware`` sent the 500. The factories (for ``gunicorn 'module:f()'``
and ``uvicorn --factory``) read ``OU_APP_DIR`` (the ledger ``provider.db`` and the
key store ``keys.db``, SQLite) from the environment; the caller is ``X-User``.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Request``.

import os
import sqlite3
from pathlib import Path
from typing import Any

from idemflow import AsyncIdempotency, Idempotency, OutcomeUnknown, Policy

POLICY = Policy(request_timeout=5)
ENDPOINTS = ["POST /payments"]


def _directory() -> Path:
    return Path(os.environ["OU_APP_DIR"])


def charge(key: str, principal: str) -> None:
    """The provider's side effect, committed before the call's answer is lost."""
    with sqlite3.connect(_directory() / "provider.db") as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS charges (key TEXT, principal TEXT)")
        conn.execute("INSERT INTO charges VALUES (?, ?)", (key, principal))


def _sync_driver() -> Idempotency:
    from idemflow.stores.sqlite import SQLiteStore

    store = SQLiteStore(_directory() / "keys.db")
    store.migrate()
    return Idempotency(store, POLICY)


def _async_driver() -> AsyncIdempotency:
    from idemflow.stores.sqlite import AsyncSQLiteStore

    store = AsyncSQLiteStore(_directory() / "keys.db")
    store.sync.migrate()
    return AsyncIdempotency(store, POLICY)


def _user_from_header(app: Any) -> Any:
    """The WSGI authentication in front of the middleware: ``X-User`` → ``REMOTE_USER``."""

    def authenticated(environ: dict[str, Any], start_response: Any) -> Any:
        environ["REMOTE_USER"] = environ.get("HTTP_X_USER", "")
        return app(environ, start_response)

    return authenticated


def _scope_user(scope: Any) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-user":
            return bytes(value).decode("latin-1")
    return None


def flask_app(hooked: bool = True) -> Any:
    """Flask behind the WSGI middleware, ``handle_outcome_unknown`` registered."""
    from flask import Flask, request

    from idemflow.integrations.flask import handle_outcome_unknown
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    app = Flask(__name__)
    if hooked:
        handle_outcome_unknown(app)

    @app.get("/healthz")
    def healthz() -> Any:
        return {"ok": True}

    @app.post("/payments")
    def pay() -> Any:
        charge(request.headers["Idempotency-Key"], request.environ["REMOTE_USER"])
        raise OutcomeUnknown("the provider did not answer")

    app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, idempotency=_sync_driver(), endpoints=ENDPOINTS
    )
    return _user_from_header(app)


def flask_app_without_the_hook() -> Any:
    """The same, the line ``handle_outcome_unknown(app)`` forgotten."""
    return flask_app(hooked=False)


# --- Django, configured here: one project, a WSGI and an ASGI handler ----------------------


def _django_pay(request: Any) -> Any:
    principal = request.headers["X-User"]
    charge(request.headers["Idempotency-Key"], principal)
    raise OutcomeUnknown("the provider did not answer")


def _django_healthz(request: Any) -> Any:
    from django.http import JsonResponse

    return JsonResponse({"ok": True})


def _configure_django() -> None:
    import django
    from django.conf import settings
    from django.urls import path

    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        SECRET_KEY="outcome-unknown-tests",
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["idemflow.integrations.django"],  # its ready() hooks the signal
        MIDDLEWARE=[],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": _directory() / "app.db"}
        },
        LOGGING_CONFIG=None,
    )
    django.setup()
    global urlpatterns  # noqa: PLW0603 -- the URLconf is this module
    urlpatterns = [path("payments", _django_pay), path("healthz", _django_healthz)]


urlpatterns: list[Any] = []


def django_wsgi() -> Any:
    """Django's WSGI handler behind the WSGI middleware."""
    _configure_django()
    from django.core.wsgi import get_wsgi_application

    from idemflow.integrations.wsgi import IdempotencyMiddleware

    protected = IdempotencyMiddleware(
        get_wsgi_application(), idempotency=_sync_driver(), endpoints=ENDPOINTS
    )
    return _user_from_header(protected)


def django_asgi() -> Any:
    """Django's ASGI handler behind the ASGI middleware."""
    _configure_django()
    from django.core.asgi import get_asgi_application

    from idemflow.integrations.starlette import IdempotencyMiddleware

    return IdempotencyMiddleware(
        get_asgi_application(),
        idempotency=_async_driver(),
        endpoints=ENDPOINTS,
        principal=_scope_user,
    )


def fastapi_outside() -> Any:
    """A FastAPI app wrapped whole by the ASGI middleware: its ServerErrorMiddleware inside."""
    from fastapi import FastAPI, Request

    from idemflow.integrations.starlette import IdempotencyMiddleware

    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/payments")
    async def pay(request: Request) -> None:
        charge(request.headers["idempotency-key"], request.headers["x-user"])
        raise OutcomeUnknown("the provider did not answer")

    return IdempotencyMiddleware(
        app, idempotency=_async_driver(), endpoints=ENDPOINTS, principal=_scope_user
    )
