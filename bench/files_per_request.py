"""
How many files of ``src/idemflow`` one protected first execution runs through.

Run::

    .venv/bin/python -m bench.files_per_request [--door starlette|django|all]

After a warm-up request (imports done, caches filled), one request with a new
``Idempotency-Key`` is traced with ``sys.setprofile``: every Python function
called is noted by its file. Doors: (a) a Starlette app behind the ASGI
middleware, on the memory store; (b) a Django ``@idempotent`` view on a SQLite
database through ``DjangoStore``. Issue 32's target: at most 8 files each.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import idemflow

LIBRARY = str(Path(idemflow.__file__).resolve().parent)


def traced(call: Callable[[], Any]) -> list[str]:
    """The library files whose functions ``call`` ran, relative to ``src/idemflow``."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return sorted(
        str(Path(name).resolve().relative_to(LIBRARY))
        for name in seen
        if str(Path(name).resolve()).startswith(LIBRARY + "/")
    )


def starlette_door() -> Callable[[], Any]:
    """A POST through the ASGI middleware to a Starlette endpoint; returns one request."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from idemflow import AsyncIdempotency
    from idemflow.integrations.asgi import IdempotencyMiddleware
    from idemflow.stores import AsyncMemoryStore

    async def create(request: Request) -> JSONResponse:
        return JSONResponse(await request.json(), status_code=201)

    app = Starlette(routes=[Route("/things", create, methods=["POST"])])
    guarded = IdempotencyMiddleware(
        app,
        idempotency=AsyncIdempotency(AsyncMemoryStore()),
        endpoints=["POST /things"],
        principal=lambda scope: "alice",
    )

    async def post() -> int:
        body = b'{"name": "a"}'
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/things",
            "raw_path": b"/things",
            "query_string": b"",
            "root_path": "",
            "server": ("test", 80),
            "client": ("test", 1),
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"idempotency-key", uuid.uuid4().hex.encode()),
            ],
        }
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await guarded(scope, receive, send)
        return int(sent[0]["status"])

    loop = asyncio.new_event_loop()
    return lambda: loop.run_until_complete(post())


def django_door() -> Callable[[], Any]:
    """A POST to a Django ``@idempotent`` view, SQLite and ``DjangoStore``."""
    import django
    from django.conf import settings

    directory = tempfile.mkdtemp(prefix="idemflow-files-")
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        SECRET_KEY="bench",
        INSTALLED_APPS=["idemflow.integrations.django"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": f"{directory}/db"}},
        IDEMFLOW={"principal": lambda request: "alice"},
    )
    django.setup()
    from django.http import JsonResponse
    from django.test import Client
    from django.urls import path

    from idemflow.integrations.django import get_store, idempotent

    get_store().migrate()  # type: ignore[attr-defined]

    @idempotent
    def create(request: Any) -> JsonResponse:
        return JsonResponse({"name": "a"}, status=201)

    globals()["urlpatterns"] = [path("things", create)]
    client = Client()

    def post() -> int:
        answer = client.post(
            "/things",
            data=b'{"name": "a"}',
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex,
        )
        return int(answer.status_code)

    return post


DOORS = {"starlette": starlette_door, "django": django_door}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--door", choices=(*DOORS, "all"), default="all")
    args = parser.parse_args(argv)
    for name in DOORS if args.door == "all" else [args.door]:
        post = DOORS[name]()
        assert post() == 201  # the warm-up
        status: list[int] = []
        files = traced(lambda: status.append(post()))  # noqa: B023 -- called at once
        assert status == [201], status
        print(f"{name}: {len(files)} files")
        for file in files:
            print(f"  {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
