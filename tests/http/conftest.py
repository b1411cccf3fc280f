"""
Real servers for the HTTP tests: the demo as a subprocess (``python -m idemflow
demo --port 0``), small apps in a uvicorn thread, both on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import Record
from idemflow._errors import PROBLEM_BASE
from idemflow._http import NOT_STORED_SLUG
from tests.conftest import POSTGRES_URL, unreachable
from tests.problem_pages import page, slug_of

#: The demo's key table (its key prefix on Redis, unless the URL names one).
KEY_TABLE = "idemflow_keys"

ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}
PAYMENT = {"amount": 1000, "currency": "EUR", "customer": "ada"}
STARTUP_SECONDS = 20


def new_key() -> str:
    return f"test-{uuid.uuid4().hex}"


#: ``Idempotency-Key`` field lines, as sent on the wire, that every door (the ASGI edge,
#: Django's, Flask's, the WSGI middleware) answers with the 400 ``invalid-key`` problem
#: before anything is claimed or run: one table for all of them (``idemflow._identity``'s rules).
#: Two lines reach a WSGI application as one value joined by ``,`` (a list, refused too).
MALFORMED_KEYS: dict[str, tuple[bytes, ...]] = {
    "empty": (b"",),
    "256-characters": (b"x" * 256,),
    "quoted-256-characters": (b'"' + b"x" * 256 + b'"',),
    "8000-characters": (b"x" * 8000,),
    "non-ascii-utf-8": ("caf\u00e9".encode(),),
    "non-ascii-latin-1": (b"caf\xe9",),
    "tab": (b"a\tb",),
    "list": (b"a,b",),
    "parameters": (b"k;p=1",),
    "quoted-unterminated": (b'"unterminated',),
    "quoted-bad-escape": (b'"a\\x"',),
    "quoted-then-more": (b'"a"b',),
    "two-lines": (b"k-1", b"k-2"),
}
#: Control characters in the key: the 400 ``invalid-key`` problem where the HTTP server
#: passes them on (uvicorn with httptools, in process); gunicorn answers its own 400 first.
CONTROL_KEYS: dict[str, tuple[bytes, ...]] = {
    "control-character": (b"a\x01b",),
    "del": (b"a\x7fb",),
}


@dataclass
class Demo:
    """A running ``idemflow demo`` process and where to look at its data."""

    url: str
    data_dir: Path
    process: subprocess.Popen[str]
    banner: list[str]
    database_url: str | None = None
    log: Path = field(default_factory=Path)

    # Idle connections expire (2 s) before uvicorn's keep-alive (5 s) closes them:
    # a request sent on a connection the server is closing dies as a ReadError.
    # verify=False: plain HTTP on loopback, and httpx's default loads the CA bundle
    # for every client it makes (~40 ms of CPU each).
    def client(self, **kwargs: Any) -> httpx.Client:
        limits = httpx.Limits(keepalive_expiry=2.0)
        return httpx.Client(base_url=self.url, timeout=30, limits=limits, **kwargs, verify=False)

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        limits = httpx.Limits(
            max_connections=100, max_keepalive_connections=100, keepalive_expiry=2.0
        )
        return httpx.AsyncClient(
            base_url=self.url, timeout=30, limits=limits, **kwargs, verify=False
        )

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Read the demo's own SQL database, as an operator would: keys and payments (with
        the keys in Redis, the payments alone, in SQLite under the data folder)."""
        url = self.database_url
        if url is None or url.startswith("redis"):
            with contextlib.closing(sqlite3.connect(self.data_dir / "payments.db")) as conn:
                return conn.execute(sql, params).fetchall()
        if url.startswith(("mysql", "mariadb")):
            import pymysql

            from idemflow.stores.mysql import connect_kwargs

            with (
                pymysql.connect(**connect_kwargs(url), autocommit=True) as conn,
                conn.cursor() as cur,
            ):
                cur.execute(sql.replace("?", "%s"), params)
                return list(cur.fetchall())
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            return pg.execute(sql.replace("?", "%s"), params).fetchall()

    def key_state(self, principal: str, key: str) -> tuple[str, int | None] | None:
        """The key record's state and stored status, or None when nothing is recorded."""
        return self.key_states(principal, [key])[0]

    def key_states(self, principal: str, keys: list[str]) -> list[tuple[str, int | None] | None]:
        """:meth:`key_state` of each key."""
        return [
            None if r is None else (r.state.value, r.response.status if r.response else None)
            for r in self.key_records(principal, keys)
        ]

    def key_records(self, principal: str, keys: list[str]) -> list[Record | None]:
        """Each key's record, read with the store the demo's URL opens (any backend), as
        ``idemflow`` itself reads them."""
        from idemflow.stores.urls import open_store
        from idemflow_demo.db_redis import split_prefix

        url, table = self.database_url or f"sqlite:///{self.data_dir / 'payments.db'}", KEY_TABLE
        if url.startswith("redis"):
            url, table = split_prefix(url)
        store = open_store(url, table=table)
        try:
            return [store.get(principal, key) for key in keys]
        finally:
            store.close()

    def key_rows(self, principal: str, key: str) -> list[tuple[Any, ...]]:
        return self.query(
            "SELECT state, response_status FROM idemflow_keys "
            "WHERE principal = ? AND idempotency_key = ?",
            principal,
            key,
        )

    def charges(self) -> list[dict[str, Any]]:
        with self.client() as client:
            charges: list[dict[str, Any]] = client.get("/provider/charges").json()["charges"]
            return charges


def _read_lines(stream: Any, lines: queue.Queue[str]) -> None:
    with contextlib.suppress(ValueError, OSError):  # the pipe closed under us
        for line in stream:
            lines.put(line.rstrip("\n"))


@contextlib.contextmanager
def run_demo(
    data_dir: Path,
    *args: str,
    database_url: str | None = None,
    env: Mapping[str, str] | None = None,
    startup_seconds: float = STARTUP_SECONDS,
) -> Iterator[Demo]:
    """Start ``idemflow demo`` on a free port; yield once it answers /healthz.

    ``env``: variables added to the test process's own for this demo alone (a thread
    may start one while another starts a demo without them). ``startup_seconds``:
    how long the start may take."""
    command = [sys.executable, "-m", "idemflow", "demo", "--port", "0", "--no-access-log"]
    command += ["--data-dir", str(data_dir), *args]
    if database_url:
        command += ["--database", database_url]
    log = data_dir.parent / f"{data_dir.name}.stderr"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    try:
        banner = _wait_for_banner(process, lines, log, startup_seconds)
        url = banner[0].rsplit(" ", 1)[-1]
        demo = Demo(url, data_dir, process, banner, database_url, log)
        with demo.client() as client:
            assert client.get("/healthz").status_code == 200
        yield demo
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)  # EOF once the process is gone
        if process.stdout is not None:
            process.stdout.close()


def _wait_for_banner(
    process: subprocess.Popen[str], lines: queue.Queue[str], log: Path, seconds: float
) -> list[str]:
    deadline = time.monotonic() + seconds
    banner: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        banner.append(line)
        if "(Ctrl-C stops)" in line:
            return banner
    raise AssertionError(f"the demo did not start: {banner}\n{log.read_text()}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """One demo on SQLite for a whole module; tests use keys of their own."""
    with run_demo(tmp_path_factory.mktemp("demo") / "data") as running:
        yield running


@contextlib.contextmanager
def pg_schema() -> Iterator[str]:
    """A PostgreSQL URL whose tables land in a fresh schema, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    schema = f"demo_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose tables land in a fresh schema, dropped afterwards."""
    with pg_schema() as url:
        yield url


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a thread on a free loopback port; yield its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    # Idle keep-alive connections kept a minute, not uvicorn's 5 s: on a loaded machine a
    # client may send its next POST on one the server is closing (an httpx.ReadError).
    config = uvicorn.Config(
        app, lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError("uvicorn did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def assert_problem(
    response: httpx.Response, status: int, slug: str | None = None
) -> dict[str, Any]:
    """An RFC 9457 problem body with type, title, status, detail and its type's ``retryable``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert {"type", "title", "status", "detail", "retryable"} <= set(body)
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    assert isinstance(body["retryable"], bool)
    if slug is not None:
        assert body["type"] == PROBLEM_BASE + slug
    # Its type is published, and the body agrees with what the page tells clients.
    published = page(slug_of(body["type"]))
    assert published.uri == body["type"]
    if published.status is not None:
        assert published.status == status
        if published.slug != NOT_STORED_SLUG:  # the marker's verdict decides (test_edge)
            assert body["retryable"] is published.retryable, published.slug
    return body
