"""
A streamed answer through every door, once the endpoint has run.

Rule (docs/crash-safety.md, "The response cannot be stored"): once an endpoint has run
without a transaction that rolls it back, no failure of ours (reading, checking or storing
its answer) may release the key. Each door is sent the same key three times while its
endpoint answers with a streamed body, a file (``direct_passthrough``), a generator or
server-sent events; the endpoint's effect (a row) must be committed at most once, and
where it committed the key must be settled, never released.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import State
from idemflow.stores.sqlite import SQLiteStore

pytest.importorskip("flask")

NOT_STORED = "https://idemflow.dev/problems/response-not-stored"
KINDS = ["streamed", "file", "generator", "sse", "stream-with-context"]


@contextlib.contextmanager
def sqlite_keys(tmp_path: Path) -> Iterator[tuple[Path, SQLiteStore]]:
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE payment (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()
    store = SQLiteStore(path)
    store.migrate()
    try:
        yield path, store
    finally:
        store.close()


def payments(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM payment").fetchone()[0])


def flask_answer(kind: str, tmp_path: Path) -> Any:
    """What a Flask view returns for ``kind``: each one a response Flask streams."""
    from flask import Response, send_file, stream_with_context

    def events() -> Iterator[str]:
        yield "data: charged\n\n"
        yield "data: done\n\n"

    if kind == "streamed":
        return Response(iter([b"charged"]), status=201, headers={"Location": "/payments/1"})
    if kind == "file":
        receipt = tmp_path / "receipt.txt"
        receipt.write_bytes(b"receipt")
        return send_file(receipt, mimetype="text/plain")
    if kind == "generator":
        return (chunk for chunk in ["charged", "!"])
    if kind == "sse":
        return Response(events(), mimetype="text/event-stream")
    return Response(stream_with_context(events()), status=201)


@pytest.mark.parametrize("kind", KINDS)
def test_flask_without_a_transaction_runs_a_streamed_view_once_and_settles_the_key(
    kind: str, tmp_path: Path
) -> None:
    """``@idem.protect`` with neither ``db=`` nor ``transaction=``: the view answers with a
    body Flask streams. Before, ``from_flask`` refused it inside the handler, after the view
    ran, and the flow took that for the view's own failure: released, and every retry ran
    the view again (three POSTs: three rows, record released). Now the view runs once, the
    first caller gets the 500 ``response-not-stored`` marker naming the view's status, the
    retries its replay, and the record is settled."""
    from flask import Flask

    from idemflow.integrations.flask import Idempotency

    with sqlite_keys(tmp_path) as (path, store):
        app = Flask(__name__)
        idem = Idempotency(app, store=store, principal=lambda: "alice")

        @app.post("/payments")
        @idem.protect
        def pay() -> Any:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("INSERT INTO payment (note) VALUES ('charged')")
                conn.commit()
            return flask_answer(kind, tmp_path)

        client = app.test_client()
        headers = {"Idempotency-Key": f"k-{kind}"}
        answers = [client.post("/payments", json={"amount": 10}, headers=headers) for _ in "123"]
        record = store.get("alice", f"k-{kind}")

    assert payments(path) == 1  # the view ran once
    assert record is not None
    assert record.state is State.COMPLETED, record.state
    first, *retries = answers
    problem = first.get_json()
    assert (first.status_code, problem["type"]) == (500, NOT_STORED), first.data
    created = kind in ("streamed", "stream-with-context")
    assert problem["original_status"] == (201 if created else 200)
    if kind == "streamed":
        assert problem["location"] == "/payments/1"
    for retry in retries:
        assert (retry.status_code, retry.data) == (500, first.data)
        assert retry.headers["Idempotent-Replayed"] == "true"
