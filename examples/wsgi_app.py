"""
A plain WSGI payments app, protected by idemflow's WSGI middleware.

No framework: one callable writes a payment row and answers JSON. The five
idemflow lines are in :func:`create_app`. Serve it with any WSGI server::

    pip install idemflow gunicorn
    gunicorn --chdir examples -k gthread --threads 8 wsgi_app:app
    curl -i -X POST localhost:8000/payments -H 'Authorization: Bearer alice' \\
         -H 'Idempotency-Key: order-42' -d '{"amount": 1000, "currency": "EUR", "customer": "ada"}'

Run the same ``curl`` again: the answer is replayed (``Idempotent-Replayed:
true``) and no second row is written.

Configuration (environment variables):

- ``WSGI_APP_DATA``: the directory of the SQLite files (``payments.db``, and
  ``keys.db`` for the idempotency keys); default ``<tmp>/idemflow-wsgi-app``;
- ``WSGI_APP_DATABASE_URL``: a ``postgresql://`` URL: payments and keys in
  PostgreSQL instead (``pip install 'idemflow[postgres]'``).

Authentication is a stand-in: ``Authorization: Bearer <name>`` makes ``<name>``
the principal (``REMOTE_USER``), as a real authentication middleware would.

The stand-in payment provider can be told how to behave, so you can watch
each rule: ``X-Provider: down`` answers 503 and writes nothing (the key is
released; the retry really runs), ``X-Provider: error`` raises (a 500 from the
server; released too). The receipt's file name carries the customer's name,
a realistic bug: a name outside latin-1 (``"€uro"``) makes that header
unsendable after the payment was written, and idemflow settles the key with a
``response-not-stored`` marker rather than charge again on the retry.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

from idemflow import Idempotency, Policy
from idemflow.integrations.wsgi import IdempotencyMiddleware

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

ENDPOINTS = ["POST /payments", "POST /payments/{id}/refunds"]
MAX_BODY = 1_048_576
DEFAULT_DATA = Path(tempfile.gettempdir()) / "idemflow-wsgi-app"


class Database:
    """The payments table, in SQLite or PostgreSQL: the app's own writes, not idemflow's."""

    def __init__(self, url: str | None, data: Path) -> None:
        self.url = url
        self._path = data / "payments.db"
        self._pool: Any = None
        if url is not None:
            import psycopg_pool

            self._pool = psycopg_pool.ConnectionPool(
                url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=True
            )
        self._migrate()

    def _migrate(self) -> None:
        if self._pool is None:
            with self._sqlite() as conn:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS payments (id INTEGER PRIMARY KEY, "
                    "principal TEXT, amount INTEGER, currency TEXT, customer TEXT, "
                    "refund_of INTEGER)"
                )
            return
        with self._pool.connection() as conn, conn.transaction():
            # Every worker process migrates at start-up: one at a time.
            conn.execute("SELECT pg_advisory_xact_lock(7302)")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS payments (id BIGSERIAL PRIMARY KEY, "
                "principal TEXT, amount INTEGER, currency TEXT, customer TEXT, "
                "refund_of BIGINT)"
            )

    @contextlib.contextmanager
    def _sqlite(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self._path, timeout=30, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    def insert(self, principal: str, payment: dict[str, Any], refund_of: int | None) -> int:
        row = (principal, payment["amount"], payment["currency"], payment["customer"], refund_of)
        if self._pool is None:
            with self._sqlite() as conn:
                cursor = conn.execute(
                    "INSERT INTO payments (principal, amount, currency, customer, refund_of) "
                    "VALUES (?, ?, ?, ?, ?)",
                    row,
                )
                return int(cursor.lastrowid or 0)
        with self._pool.connection() as conn:
            found = conn.execute(
                "INSERT INTO payments (principal, amount, currency, customer, refund_of) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                row,
            ).fetchone()
            return int(found[0])

    def listed(self, principal: str) -> list[dict[str, Any]]:
        sql = "SELECT id, amount, currency, customer, refund_of FROM payments WHERE principal = "
        if self._pool is None:
            with self._sqlite() as conn:
                rows = conn.execute(sql + "? ORDER BY id", (principal,)).fetchall()
        else:
            with self._pool.connection() as conn:
                rows = conn.execute(sql + "%s ORDER BY id", (principal,)).fetchall()
        names = ("id", "amount", "currency", "customer", "refund_of")
        return [dict(zip(names, row, strict=True)) for row in rows]


class PaymentsApp:
    """The WSGI application: knows nothing of idempotency keys."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/")
        principal = environ.get("REMOTE_USER")
        parts = path.strip("/").split("/")
        if path == "/healthz":
            return respond(start_response, 200, {"status": "ok"})
        if principal is None:
            return respond(start_response, 401, {"title": "authenticate first"})
        if parts == ["payments"] and method == "GET":
            return respond(start_response, 200, {"payments": self.database.listed(principal)})
        if parts == ["payments"] and method == "POST":
            return self.pay(environ, start_response, principal, None)
        refund = len(parts) == 3 and parts[0] == "payments" and parts[2] == "refunds"
        if refund and method == "POST" and parts[1].isdigit():
            return self.pay(environ, start_response, principal, int(parts[1]))
        return respond(start_response, 404, {"title": "not found"})

    def pay(
        self,
        environ: WSGIEnvironment,
        start_response: StartResponse,
        principal: str,
        refund_of: int | None,
    ) -> Iterable[bytes]:
        payment = parse(environ["wsgi.input"].read(MAX_BODY), refund=refund_of is not None)
        if payment is None:
            return respond(start_response, 400, {"title": "amount, currency, customer required"})
        provider = environ.get("HTTP_X_PROVIDER", "up")
        if provider == "down":
            return respond(start_response, 503, {"title": "payment provider unavailable"})
        if provider == "error":
            raise RuntimeError("the payment provider's client library crashed")
        payment_id = self.database.insert(principal, payment, refund_of)
        headers = [
            ("Location", f"/payments/{payment_id}"),
            # The realistic bug described in the module docstring.
            ("Content-Disposition", f'inline; filename="receipt-{payment["customer"]}.json"'),
            ("Set-Cookie", "last_payment=1"),  # sent to the first caller, never replayed
        ]
        body = {"id": payment_id, **payment, "refund_of": refund_of}
        return respond(start_response, 201, body, headers)


def parse(raw: bytes, *, refund: bool) -> dict[str, Any] | None:
    try:
        payment = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(payment, dict) or not isinstance(payment.get("amount"), int):
        return None
    if refund:
        payment.setdefault("currency", "EUR")
        payment.setdefault("customer", "refund")
    if not isinstance(payment.get("currency"), str) or not isinstance(payment.get("customer"), str):
        return None
    return {k: payment[k] for k in ("amount", "currency", "customer")}


def respond(
    start_response: StartResponse,
    status: int,
    content: Any,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    body = json.dumps(content).encode()
    start_response(
        f"{status} {HTTPStatus(status).phrase}",
        [("Content-Type", "application/json"), *(headers or [])],
    )
    return [body]


class BearerAuth:
    """Stand-in authentication: ``Authorization: Bearer <name>`` sets ``REMOTE_USER``."""

    def __init__(self, app: WSGIApplication) -> None:
        self.app = app

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        scheme, _, name = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme == "Bearer" and name:
            environ["REMOTE_USER"] = name
        return self.app(environ, start_response)


def key_store(url: str | None, data: Path) -> Any:
    """Where the idempotency keys live: next to the payments."""
    if url is not None:
        from idemflow.stores.postgres import PostgresStore

        return PostgresStore(url, max_size=4)
    from idemflow.stores.sqlite import SQLiteStore

    return SQLiteStore(data / "keys.db")


def create_app(url: str | None = None, data: Path | None = None) -> WSGIApplication:
    data = data or DEFAULT_DATA
    data.mkdir(parents=True, exist_ok=True)
    payments = PaymentsApp(Database(url, data))
    # idemflow: a store, a driver, and the middleware around the app.
    store = key_store(url, data)
    store.migrate()
    idempotency = Idempotency(store, Policy(request_timeout=30))
    protected = IdempotencyMiddleware(payments, idempotency=idempotency, endpoints=ENDPOINTS)
    return BearerAuth(protected)  # authentication runs first: it sets the principal


app = create_app(
    os.environ.get("WSGI_APP_DATABASE_URL") or None,
    Path(os.environ.get("WSGI_APP_DATA", DEFAULT_DATA)),
)


if __name__ == "__main__":
    from wsgiref.simple_server import make_server

    with make_server("127.0.0.1", 8000, app) as server:
        print("serving on http://127.0.0.1:8000 (Ctrl-C stops)")
        server.serve_forever()
