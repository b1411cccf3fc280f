"""
The Flask extension in-process (Flask's test client) on a real SQLite file: configuration
mistakes, a principal callable, and a plain SQLAlchemy session as the transaction.
The served behaviour (gunicorn, PostgreSQL) is in test_wsgi_apps.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flask")
sqlalchemy = pytest.importorskip("sqlalchemy")

from flask import Flask, g, request  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from idemflow import ConfigurationError, State  # noqa: E402
from idemflow.integrations.flask import Idempotency  # noqa: E402
from idemflow.stores.sqlite import SQLiteStore  # noqa: E402
from idemflow.transactions import SQLAlchemyTransaction  # noqa: E402


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[Any, SQLiteStore]]:
    path = tmp_path / "app.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE payment (id INTEGER PRIMARY KEY, amount INTEGER)")
    store = SQLiteStore(path)
    store.migrate()
    yield engine, store
    store.close()
    engine.dispose()


def test_no_principal_source_is_refused_at_init(database: tuple[Any, SQLiteStore]) -> None:
    """Keys are never claimed anonymously: no principal= and no Flask-Login is a start-up error."""
    _, store = database
    with pytest.raises(ConfigurationError, match="principal"):
        Idempotency(Flask(__name__), store=store)


def test_a_plain_sqlalchemy_session_carries_the_completion(
    database: tuple[Any, SQLiteStore],
) -> None:
    """transaction= with SQLAlchemyTransaction: the row and the record commit together;
    a 503 rolls the row back and releases the key; the principal comes from the callable."""
    engine, store = database
    app = Flask(__name__)

    @contextlib.contextmanager
    def session_transaction() -> Iterator[SQLAlchemyTransaction]:
        with Session(engine) as session:
            g.session = session
            yield SQLAlchemyTransaction(session)

    idem = Idempotency(
        app,
        store=store,
        transaction=session_transaction,
        principal=lambda: request.headers.get("X-User"),
    )

    @app.post("/payments/<int:order>")
    @idem.protect
    def pay(order: int) -> Any:
        g.session.execute(sqlalchemy.text("INSERT INTO payment (amount) VALUES (:a)"), {"a": order})
        if request.headers.get("X-Fail"):
            return {"error": "down"}, 503
        return {"order": order}, 201

    client = app.test_client()
    headers = {"X-User": "alice", "Idempotency-Key": "k-1"}
    failed = client.post("/payments/7", headers={**headers, "X-Fail": "1"}, json={})
    first = client.post("/payments/7", headers=headers, json={})
    replay = client.post("/payments/7", headers=headers, json={})
    other_order = client.post("/payments/8", headers=headers, json={})

    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT amount FROM payment").fetchall()
    record = store.get("alice", "k-1")
    assert failed.status_code == 503
    assert (first.status_code, replay.data, replay.headers["Idempotent-Replayed"]) == (
        201,
        first.data,
        "true",
    )
    assert other_order.status_code == 422  # path parameters are part of the request
    assert rows == [(7,)]
    assert record is not None
    assert (record.state, record.endpoint, record.attempt) == (
        State.COMPLETED,
        "POST /payments/<int:order>",
        2,
    )


def test_the_header_lines_are_werkzeugs() -> None:
    """The lines the edge gets are request.headers' (lower-case), read straight from
    the environ: CONTENT_TYPE/CONTENT_LENGTH only when set, never their HTTP_ twins,
    an empty Idempotency-Key kept (it is a 400 "empty", not a missing key)."""
    from werkzeug.datastructures import EnvironHeaders

    from idemflow.edge import raw_headers as _headers  # what flask reads by

    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "HTTP_HOST": "shop.example",
        "HTTP_IDEMPOTENCY_KEY": "",
        "HTTP_X_REQUEST_ID": "req-1",
        "HTTP_CONTENT_TYPE": "text/plain",
        "HTTP_CONTENT_LENGTH": "99",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": "",
        "wsgi.input": None,
    }
    werkzeugs = [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in EnvironHeaders(environ)
    ]
    assert _headers(environ) == werkzeugs
    assert _headers(environ) == werkzeugs  # and again, from the learned names


def test_an_async_view_runs_in_the_session_transaction(
    database: tuple[Any, SQLiteStore],
) -> None:
    """An ``async def`` view (and ``validate``) under ``@idem.protect`` is run to its end,
    as Flask runs one, inside the transaction: its row commits with the record, a 503
    rolls it back and releases the key, a retry replays (issue 31: it was a 500 on every
    request, its coroutine never awaited)."""
    engine, store = database
    app = Flask(__name__)
    validated: list[int] = []

    @contextlib.contextmanager
    def session_transaction() -> Iterator[SQLAlchemyTransaction]:
        with Session(engine) as session:
            g.session = session
            yield SQLAlchemyTransaction(session)

    idem = Idempotency(app, store=store, transaction=session_transaction, principal=lambda: "alice")

    async def validate(order: int) -> None:
        validated.append(order)

    protected: Callable[[Callable[..., Any]], Callable[..., Any]]
    protected = idem.protect(validate=validate)

    @app.post("/payments/<int:order>")
    @protected
    async def pay(order: int) -> Any:
        g.session.execute(sqlalchemy.text("INSERT INTO payment (amount) VALUES (:a)"), {"a": order})
        if request.headers.get("X-Fail"):
            return {"error": "down"}, 503
        return {"order": order}, 201

    client = app.test_client()
    headers = {"Idempotency-Key": "k-1"}
    failed = client.post("/payments/7", headers={**headers, "X-Fail": "1"}, json={})
    first = client.post("/payments/7", headers=headers, json={})
    replay = client.post("/payments/7", headers=headers, json={})

    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT amount FROM payment").fetchall()
    record = store.get("alice", "k-1")
    assert failed.status_code == 503
    assert (first.status_code, first.json) == (201, {"order": 7})
    assert (replay.data, replay.headers["Idempotent-Replayed"]) == (first.data, "true")
    assert rows == [(7,)]
    assert validated == [7, 7, 7]
    assert record is not None
    assert (record.state, record.attempt) == (State.COMPLETED, 2)
