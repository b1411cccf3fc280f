"""
``Idempotency(app, db=…)`` on the app's own database, served by Werkzeug's threaded
server on PostgreSQL and on a SQLite file: the claims use the engine's own pool (on
PostgreSQL no connection of a second pool is ever opened), the completion commits in
the view's session transaction (an exception after the view's write rolls both back
and frees the key), and 50 concurrent requests with one key make one row.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flask")
pytest.importorskip("flask_sqlalchemy")
sqlalchemy = pytest.importorskip("sqlalchemy")
httpx = pytest.importorskip("httpx")

from flask import Flask  # noqa: E402
from flask import request as http  # noqa: E402
from flask_sqlalchemy import SQLAlchemy  # noqa: E402
from sqlalchemy import event  # noqa: E402
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

from idemflow import State  # noqa: E402
from idemflow.integrations.flask import Idempotency  # noqa: E402
from tests.conftest import POSTGRES_URL  # noqa: E402
from tests.http.conftest import pg_schema  # noqa: E402

POOL_SIZE = 2


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payment"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]


@dataclass
class Shop:
    url: str
    app: Flask
    idem: Idempotency
    engine: Any
    checkouts: list[int]
    application_name: str | None

    def rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT count(*) FROM payment").scalar_one())


@pytest.fixture(params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The app's SQLAlchemy URL (a schema of its own on PostgreSQL, its connections named
    apart) and its backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shop.db'}", "sqlite"
        return
    request.applymarker(pytest.mark.postgres)
    with pg_schema() as url:
        named = f"{url}&application_name=flaskdb_{uuid.uuid4().hex[:10]}"
        yield named.replace("postgresql://", "postgresql+psycopg://", 1), "postgres"


@pytest.fixture(params=["flask-sqlalchemy", "engine"])
def shop(request: pytest.FixtureRequest, database_url: tuple[str, str]) -> Iterator[Shop]:
    """The app on ``db=``: Flask-SQLAlchemy's ``db``, or a plain engine (``idem.session``)."""
    url, backend = database_url
    options: dict[str, Any] = {}
    if backend == "postgres":
        options = {"pool_size": POOL_SIZE, "max_overflow": 0, "pool_timeout": 5}
    app = Flask(__name__)
    if request.param == "flask-sqlalchemy":
        app.config.update(SQLALCHEMY_DATABASE_URI=url, SQLALCHEMY_ENGINE_OPTIONS=options)
        db = SQLAlchemy(app, model_class=Base)
        with app.app_context():
            engine = db.engine
        idem = Idempotency(app, db=db, principal=lambda: http.headers.get("X-User"))
    else:
        engine = sqlalchemy.create_engine(url, **options)
        idem = Idempotency(app, db=engine, principal=lambda: http.headers.get("X-User"))
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_: checkouts.append(1))

    @app.post("/payments")
    @idem.protect
    def pay() -> tuple[dict[str, int], int]:
        payment = Payment(amount=int(http.get_json()["amount"]))
        idem.session.add(payment)
        idem.session.flush()  # the row is written in the request's transaction
        if http.headers.get("X-Boom"):
            raise RuntimeError("after the write")
        return {"id": payment.id}, 201

    app.extensions["idemflow"].store.migrate()
    Base.metadata.create_all(engine)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Shop(
            f"http://127.0.0.1:{server.server_port}",
            app,
            idem,
            engine,
            checkouts,
            url.rsplit("application_name=", 1)[1] if backend == "postgres" else None,
        )
    finally:
        server.shutdown()
        thread.join(10)
        app.extensions["idemflow"].store.close()
        engine.dispose()


def _backends(application_name: str) -> int:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    assert found is not None
    return int(found[0])


def test_fifty_concurrent_requests_with_one_key_make_one_row_on_the_apps_one_pool(
    shop: Shop,
) -> None:
    """One row, one completed record, every answer the first's; on PostgreSQL the app's
    server connections never outnumber its engine's pool (no second pool), and every
    request's claim was a checkout of that pool."""
    headers = {"X-User": "alice", "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while shop.application_name and not done.wait(0.02):
            seen.append(_backends(shop.application_name))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with (
            httpx.Client(base_url=shop.url, timeout=30) as client,
            concurrent.futures.ThreadPoolExecutor(50) as pool,
        ):
            answers = list(
                pool.map(
                    lambda _: client.post("/payments", json={"amount": 5}, headers=headers),
                    range(50),
                )
            )
            replay = client.post("/payments", json={"amount": 5}, headers=headers)
    finally:
        done.set()
        watcher.join()

    assert {a.status_code for a in answers} <= {201, 409}, [a.text for a in answers]
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert all(a.content == replay.content for a in answers if a.status_code == 201)
    assert shop.rows() == 1
    record = shop.app.extensions["idemflow"].store.get("alice", headers["Idempotency-Key"])
    assert record is not None
    assert record.state is State.COMPLETED
    if shop.application_name is not None:
        assert seen
        assert max(seen) <= POOL_SIZE, seen  # only the engine's pool ever connected
        assert len(shop.checkouts) >= 51  # each request's claim: a checkout of that pool


def test_an_exception_after_the_views_write_rolls_back_the_row_and_frees_the_key(
    shop: Shop,
) -> None:
    """The completion is written in the view's transaction: the view's exception after
    its write leaves neither the row nor a record; the retry runs, once."""
    headers = {"X-User": "alice", "Idempotency-Key": "k-boom"}
    with httpx.Client(base_url=shop.url, timeout=30) as client:
        boom = client.post("/payments", json={"amount": 5}, headers={**headers, "X-Boom": "1"})
        rows_after_boom = shop.rows()
        retry = client.post("/payments", json={"amount": 5}, headers=headers)
        replay = client.post("/payments", json={"amount": 5}, headers=headers)

    assert boom.status_code == 500
    assert rows_after_boom == 0
    assert (retry.status_code, "Idempotent-Replayed" in retry.headers) == (201, False)
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert shop.rows() == 1
    record = shop.app.extensions["idemflow"].store.get("alice", "k-boom")
    assert record is not None
    assert (record.state, record.attempt) == (State.COMPLETED, 2)


def test_idem_session_outside_a_protected_view_is_an_error() -> None:
    """``idem.session`` names the protected view's session: elsewhere, a clear error."""
    engine = sqlalchemy.create_engine("sqlite://")
    app = Flask(__name__)
    from idemflow.stores.memory import MemoryStore

    idem = Idempotency(app, db=engine, store=MemoryStore(), principal=lambda: "alice")
    with app.test_request_context(), pytest.raises(RuntimeError, match="protected view"):
        _ = idem.session


@pytest.mark.postgres
def test_a_session_holding_a_connection_before_the_claim_lets_the_claim_have_it() -> None:
    """One pooled connection per protected request: a ``before_request`` that queried
    through ``db.session`` holds the engine's only connection (a pool of one) when the
    claim comes; its transaction is committed first, its objects kept loaded, and the
    claim takes that connection: 201, then the replay (before: the claim waited for a
    second connection, a 503 after ``pool_timeout``)."""
    with pg_schema() as url:
        app = Flask(__name__)
        app.config.update(
            SQLALCHEMY_DATABASE_URI=url.replace("postgresql://", "postgresql+psycopg://", 1),
            SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 1, "max_overflow": 0, "pool_timeout": 1},
        )
        db = SQLAlchemy(app, model_class=Base)
        idem = Idempotency(app, db=db, principal=lambda: http.headers.get("X-User"))
        loaded: list[Payment] = []
        expired: list[set[str]] = []

        @app.before_request
        def load_before_the_claim() -> None:
            loaded[:] = db.session.scalars(sqlalchemy.select(Payment)).all()

        @app.post("/payments")
        @idem.protect
        def pay() -> tuple[dict[str, int], int]:
            expired.extend(set(sqlalchemy.inspect(p).expired_attributes) for p in loaded)
            payment = Payment(amount=sum(p.amount for p in loaded) + 5)
            db.session.add(payment)
            db.session.flush()
            return {"amount": payment.amount}, 201

        with app.app_context():
            app.extensions["idemflow"].store.migrate()
            Base.metadata.create_all(db.engine)
            db.session.add(Payment(amount=1))
            db.session.commit()
        client = app.test_client()
        headers = {"X-User": "alice", "Idempotency-Key": "k-one-connection"}
        first = client.post("/payments", headers=headers)
        replay = client.post("/payments", headers=headers)
        with app.app_context():
            db.engine.dispose()

    assert (first.status_code, first.get_json()) == (201, {"amount": 6}), first.text
    assert (replay.status_code, replay.headers.get("Idempotent-Replayed")) == (201, "true")
    assert expired == [set()]  # what the before_request loaded, still loaded in the view


@pytest.mark.postgres
def test_a_forked_worker_claims_on_the_engine_as_its_parent_did() -> None:
    """``gunicorn --preload``: the app made, and a checkout waited for apart (its thread
    started), in the parent; the forked child's checkouts get threads of its own (the
    parent's are not its): 201, not a 503 after the store wait."""
    with pg_schema() as url:
        engine = sqlalchemy.create_engine(
            url.replace("postgresql://", "postgresql+psycopg://", 1), pool_timeout=1
        )
        app = Flask(__name__)
        idem = Idempotency(app, db=engine, principal=lambda: "alice")

        @app.post("/payments")
        @idem.protect
        def pay() -> tuple[dict[str, int], int]:
            return {"ok": 1}, 201

        app.extensions["idemflow"].store.migrate()  # a checkout, in the parent
        child = os.fork()
        if child == 0:  # pragma: no cover -- the child reports by its exit status
            code = 1
            try:
                engine.dispose(close=False)  # SQLAlchemy's rule in a forked child
                answer = app.test_client().post("/payments", headers={"Idempotency-Key": "k"})
                code = 0 if answer.status_code == 201 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        engine.dispose()

    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.postgres
def test_a_database_gone_while_the_session_holds_its_connection_is_the_claims_503() -> None:
    """The session's connection, held since the ``before_request``, is lost before the
    claim (its server session ended): committing what the session began fails, a 503
    ``store-unavailable`` from the claim (counted), nothing recorded; the retry runs."""
    from idemflow import Event
    from tests.faults import terminate

    name = f"flaskgone_{uuid.uuid4().hex[:10]}"
    with pg_schema() as url:
        app = Flask(__name__)
        app.config.update(
            SQLALCHEMY_DATABASE_URI=url.replace("postgresql://", "postgresql+psycopg://", 1)
            + f"&application_name={name}",
            SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 1, "max_overflow": 0, "pool_timeout": 1},
        )
        db = SQLAlchemy(app, model_class=Base)
        seen: list[Event] = []
        idem = Idempotency(
            app,
            db=db,
            principal=lambda: "alice",
            observer=lambda event, intent, elapsed: seen.append(event),
        )

        @app.before_request
        def query_then_lose_the_connection() -> None:
            db.session.execute(sqlalchemy.text("SELECT 1"))
            if http.headers.get("X-Lose"):
                terminate(name)

        @app.post("/payments")
        @idem.protect
        def pay() -> tuple[dict[str, int], int]:
            return {"ok": 1}, 201

        with app.app_context():
            app.extensions["idemflow"].store.migrate()
        client = app.test_client()
        lost = client.post("/payments", headers={"Idempotency-Key": "k", "X-Lose": "1"})
        record = app.extensions["idemflow"].store.get("alice", "k")
        retry = client.post("/payments", headers={"Idempotency-Key": "k"})
        with app.app_context():
            db.engine.dispose()

    assert lost.status_code == 503, lost.text
    assert lost.get_json()["type"].endswith("/store-unavailable")
    assert Event.STORE_UNAVAILABLE in seen
    assert record is None
    assert (retry.status_code, "Idempotent-Replayed" in retry.headers) == (201, False)
