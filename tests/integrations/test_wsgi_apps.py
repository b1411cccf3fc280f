"""
The example apps under examples/, served by gunicorn (gthread workers) on 127.0.0.1.

One server per (app, database): the Django shop on SQLite, PostgreSQL and
MariaDB, the Flask shop on SQLite and PostgreSQL, each on a database created
for the module. The servers the selected tests use are started when the module
starts, two at a time (two cores), in the order the tests need them. Every
scenario uses a principal of its own, so the business rows it counts are its own.
The Django shop protects four endpoints (a function view, a class-based view, a
DRF action, the middleware); each scenario runs on every one of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("gunicorn")
pytest.importorskip("django")
pytest.importorskip("flask_sqlalchemy")

from tests.backends import MYSQL_URL  # noqa: E402
from tests.conftest import POSTGRES_URL, selected_in_module, unreachable  # noqa: E402
from tests.http.conftest import CONTROL_KEYS, MALFORMED_KEYS  # noqa: E402
from tests.http.rawhttp import post_declaring, send_partial  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DJANGO_PATHS = ["/payments", "/cbv/payments", "/drf/payments", "/mw/payments"]
_LISTENING = re.compile(r"Listening at: http://127\.0\.0\.1:(\d+)")
#: ``verify=`` for one-off httpx requests to these plain-HTTP loopback servers: there is
#: no certificate to verify, and the default (True) loads the CA bundle for every
#: request, some 40 ms of CPU each, more than the request itself.
PLAIN_HTTP = False


@dataclass
class Shop:
    """A running example app and the database behind it."""

    base: str
    url: str
    table: str
    key_table: str = "idemflow_keys"

    def rows(self, principal: str) -> int:
        return int(
            self._query(f"SELECT count(*) FROM {self.table} WHERE principal = %s", principal)
        )

    def key_rows(self, principal: str) -> int:
        return int(
            self._query(f"SELECT count(*) FROM {self.key_table} WHERE principal = %s", principal)
        )

    def state(self, principal: str) -> str | None:
        found = self._query(f"SELECT state FROM {self.key_table} WHERE principal = %s", principal)
        return None if found is None else str(found)

    def _query(self, sql: str, value: str) -> Any:
        if self.url.startswith("sqlite"):
            with contextlib.closing(sqlite3.connect(self.url[len("sqlite:///") :])) as lite:
                row = lite.execute(sql.replace("%s", "?"), (value,)).fetchone()
        elif self.url.startswith("postgresql"):
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as conn:
                row = conn.execute(sql, (value,)).fetchone()
        else:
            import pymysql

            from idemflow.stores.mysql import connect_kwargs

            conn = pymysql.connect(**connect_kwargs(self.url))
            with contextlib.closing(conn), conn.cursor() as cursor:
                cursor.execute(sql, (value,))
                row = cursor.fetchone()
        if row is None:
            return None
        value = row[0]
        return value.decode() if isinstance(value, bytes) else value


@contextlib.contextmanager
def _database(vendor: str, tmp: Path) -> Iterator[str]:
    """A database of the module's own on ``vendor``: its URL."""
    name = f"idemflow_ex_{uuid.uuid4().hex[:10]}"
    if vendor == "sqlite":
        yield f"sqlite:///{tmp / 'shop.db'}"
        return
    if vendor == "postgres":
        import psycopg

        try:
            admin = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
        except psycopg.OperationalError as exc:
            unreachable("PostgreSQL", exc)
        with admin:
            admin.execute(f"CREATE DATABASE {name}")
        try:
            yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
        finally:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        return
    import pymysql

    from idemflow.stores.mysql import connect_kwargs

    kwargs = connect_kwargs(MYSQL_URL)
    try:
        admin = pymysql.connect(**kwargs, autocommit=True, connect_timeout=3)
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    with contextlib.closing(admin), admin.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    try:
        yield MYSQL_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with contextlib.closing(pymysql.connect(**kwargs)) as admin, admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {name}")


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        args, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


@contextlib.contextmanager
def _gunicorn(
    app: str,
    cwd: Path,
    env: dict[str, str],
    log: Path,
    *,
    graceful_timeout: int = 5,
    config: Path | None = None,
) -> Iterator[str]:
    """gunicorn with 2 gthread workers of 8 threads on a free loopback port: its base URL.

    ``graceful_timeout``: how long SIGTERM lets requests in flight finish before the
    master kills their workers; ``config``: a gunicorn config file (server hooks)."""
    args = [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "8", "-w", "2"]
    # No control socket: its default path is one per user, and parallel test
    # servers would take it from each other.
    args += ["-b", "127.0.0.1:0", "--no-control-socket"]
    args += ["--graceful-timeout", str(graceful_timeout)]
    args += [] if config is None else ["-c", str(config)]
    args += ["--log-file", str(log), app]
    process = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60  # two Django workers booting on a loaded machine
        port = None
        while port is None and time.monotonic() < deadline and process.poll() is None:
            found = _LISTENING.search(log.read_text() if log.exists() else "")
            port = found.group(1) if found else None
            time.sleep(0.05)  # polling the log with a deadline
        assert port is not None, log.read_text() if log.exists() else "gunicorn did not start"
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, deadline)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(base: str, deadline: float) -> None:
    """Both workers booted: poll until requests are answered (a 404/405 is an answer)."""
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/", timeout=2, verify=PLAIN_HTTP)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("gunicorn does not answer")


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env["SHOP_DATABASE_URL"] = url
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


#: The frameworks' own cap on a body in memory on the module's shops (Django's
#: ``DATA_UPLOAD_MAX_MEMORY_SIZE``, Flask's ``MAX_CONTENT_LENGTH``): below idemflow's cap
#: (``max_body_bytes``, 1 MiB), so it is the body cap of their doors.
FRAMEWORK_CAP = 512 * 1024

#: The ``django-pool`` server's pool: Django's psycopg pool of this many connections per
#: worker (two workers of eight threads), whose checkout waits at most POOL_WAIT seconds.
POOL_SIZE, POOL_WAIT = 1, 10


def _django_shop(
    vendor: str,
    tmp: Path,
    stack: contextlib.ExitStack,
    *,
    atomic_requests: bool = False,
    pool: int | None = None,
    upload_cap: int | None = None,
    database: str | None = None,
    gunicorn: dict[str, Any] | None = None,
) -> Shop:
    """The Django shop on a database of its own on ``vendor`` (or on ``database``, a URL),
    migrated, under gunicorn (``gunicorn``: :func:`_gunicorn`'s options)."""
    cwd = EXAMPLES / "django_app"
    env = _env(database or stack.enter_context(_database(vendor, tmp)))
    env["SHOP_ATOMIC_REQUESTS"] = "1" if atomic_requests else "0"
    if upload_cap is not None:
        env["SHOP_DATA_UPLOAD_MAX_MEMORY_SIZE"] = str(upload_cap)
    if pool is not None:
        env.update(SHOP_POOL_SIZE=str(pool), SHOP_POOL_TIMEOUT=str(POOL_WAIT))
    _run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd, env)
    log = tmp / "gunicorn.log"
    base = stack.enter_context(_gunicorn("shop.wsgi", cwd, env, log, **(gunicorn or {})))
    return Shop(base, env["SHOP_DATABASE_URL"], "shop_payment")


def _flask_shop(
    vendor: str,
    tmp: Path,
    stack: contextlib.ExitStack,
    *,
    upload_cap: int | None = None,
    database: str | None = None,
    gunicorn: dict[str, Any] | None = None,
) -> Shop:
    """The Flask shop, as :func:`_django_shop`."""
    cwd = EXAMPLES / "flask_app"
    env = _env(database or stack.enter_context(_database(vendor, tmp)))
    if upload_cap is not None:
        env["SHOP_MAX_CONTENT_LENGTH"] = str(upload_cap)
    flask = [sys.executable, "-m", "flask", "--app", "app"]
    _run([*flask, "init-db"], cwd, env)
    _run([*flask, "idemflow", "migrate"], cwd, env)
    log = tmp / "gunicorn.log"
    base = stack.enter_context(_gunicorn("app:app", cwd, env, log, **(gunicorn or {})))
    return Shop(base, env["SHOP_DATABASE_URL"], "payment")


class Servers:
    """The module's servers, started ahead of use, stopped when the module ends."""

    def __init__(self, tmp: pytest.TempPathFactory, wanted: list[tuple[str, str]]) -> None:
        self._tmp = tmp
        # Two at a time: more would only share the two cores, and each start-up must
        # answer within its deadline on a loaded machine.
        self._starter = ThreadPoolExecutor(max_workers=2)
        self._lock = threading.Lock()
        self._stacks: list[contextlib.ExitStack] = []
        self._shops: dict[tuple[str, str], Future[Shop]] = {}
        for app, vendor in wanted:  # in test order
            self._submit(app, vendor)

    def get(self, app: str, vendor: str) -> Shop:
        return self._submit(app, vendor).result(timeout=300)

    def close(self) -> None:
        """Stop every server and drop its database, all at once."""
        self._starter.shutdown(wait=True)
        if self._stacks:
            with ThreadPoolExecutor(max_workers=len(self._stacks)) as stopping:
                list(stopping.map(contextlib.ExitStack.close, self._stacks))

    def _submit(self, app: str, vendor: str) -> Future[Shop]:
        with self._lock:
            if (app, vendor) not in self._shops:
                self._shops[app, vendor] = self._starter.submit(self._start, app, vendor)
            return self._shops[app, vendor]

    def _start(self, app: str, vendor: str) -> Shop:
        stack = contextlib.ExitStack()
        with self._lock:
            self._stacks.append(stack)
        tmp = self._tmp.mktemp(f"{app}-{vendor}")
        if app == "flask":
            return _flask_shop(vendor, tmp, stack, upload_cap=FRAMEWORK_CAP)
        if app == "django-pool":
            return _django_shop(vendor, tmp, stack, atomic_requests=True, pool=POOL_SIZE)
        atomic = app == "django-atomic"
        return _django_shop(vendor, tmp, stack, atomic_requests=atomic, upload_cap=FRAMEWORK_CAP)


def _server_of(item: pytest.Item) -> tuple[str, str] | None:
    atomic_sqlite = test_sqlite_under_atomic_requests_protects_function_views_and_refuses_methods
    if getattr(item, "function", None) is atomic_sqlite:
        return "django-atomic", "sqlite"
    if getattr(item, "function", None) is test_a_pool_of_one_per_worker_serves_every_door_at_once:
        return "django-pool", "postgres"
    callspec = getattr(item, "callspec", None)
    endpoint = None if callspec is None else callspec.params.get("endpoint")
    return None if endpoint is None else (endpoint[0], endpoint[1])


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    started = Servers(tmp_path_factory, selected_in_module(request, _server_of))
    try:
        yield started
    finally:
        started.close()


@dataclass
class Endpoint:
    shop: Shop
    path: str

    def post(
        self,
        key: str | None,
        principal: str | None,
        body: bytes | Iterable[bytes] = b'{"amount": 10}',
        **headers: str,
    ) -> Any:
        sent = {"content-type": "application/json"}
        if key is not None:
            sent["idempotency-key"] = key
        if principal is not None:
            sent["x-user"] = principal
        sent.update({k.replace("_", "-"): v for k, v in headers.items()})
        url = self.shop.base + self.path
        return httpx.post(url, content=body, headers=sent, timeout=30, verify=PLAIN_HTTP)


_MARKS = {"sqlite": (), "postgres": (pytest.mark.postgres,), "mysql": (pytest.mark.mysql,)}
ENDPOINTS = (
    [
        pytest.param(("django", vendor, path), marks=_MARKS[vendor], id=f"django-{vendor}{path}")
        for vendor in ("sqlite", "postgres", "mysql")
        for path in DJANGO_PATHS
    ]
    + [
        # ATOMIC_REQUESTS=True: the function views opt out (idemflow's transaction instead);
        # the CBV and DRF methods run inside the request's transaction (a savepoint).
        pytest.param(
            ("django-atomic", vendor, path),
            marks=_MARKS[vendor],
            id=f"django-atomic-{vendor}{path}",
        )
        for vendor in ("postgres", "mysql")
        for path in DJANGO_PATHS
    ]
    + [
        pytest.param(("flask", vendor, "/payments"), marks=_MARKS[vendor], id=f"flask-{vendor}")
        for vendor in ("sqlite", "postgres")
    ]
)


@pytest.fixture(params=ENDPOINTS)
def endpoint(request: pytest.FixtureRequest, servers: Servers) -> Endpoint:
    app, vendor, path = request.param
    return Endpoint(servers.get(app, vendor), path)


def who() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def test_first_execution_then_a_byte_identical_replay(endpoint: Endpoint) -> None:
    alice = who()
    first = endpoint.post("k-1", alice)
    replay = endpoint.post("k-1", alice)

    assert first.status_code == 201, first.text
    assert (replay.status_code, replay.content) == (201, first.content)
    assert replay.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert replay.headers["content-type"] == first.headers["content-type"]
    assert replay.headers["idempotency-original-request-id"] == first.headers["x-request-id"]
    assert endpoint.shop.rows(alice) == 1


def test_the_same_key_for_another_body_is_a_422(endpoint: Endpoint) -> None:
    alice = who()
    assert endpoint.post("k-1", alice).status_code == 201
    reused = endpoint.post("k-1", alice, b'{"amount": 99}')

    assert reused.status_code == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert reused.json()["type"].endswith("/key-reused")
    assert endpoint.shop.rows(alice) == 1


def test_a_duplicate_of_a_running_request_is_a_409_with_retry_after(
    endpoint: Endpoint, tmp_path: Path
) -> None:
    alice, gate = who(), tmp_path / "release"
    results: list[Any] = []
    first = threading.Thread(
        target=lambda: results.append(endpoint.post("k-1", alice, x_hold=str(gate)))
    )
    first.start()
    try:
        deadline = time.monotonic() + 10
        while endpoint.shop.state(alice) != "in_progress" and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the key table with a deadline
        duplicate = endpoint.post("k-1", alice)
    finally:
        gate.touch()
        first.join(timeout=30)

    assert duplicate.status_code == 409
    assert int(duplicate.headers["retry-after"]) >= 1
    assert results[0].status_code == 201
    assert endpoint.post("k-1", alice).content == results[0].content
    assert endpoint.shop.rows(alice) == 1


def test_fifty_parallel_identical_posts_make_one_business_row(endpoint: Endpoint) -> None:
    alice = who()
    with ThreadPoolExecutor(max_workers=50) as pool:
        answers = list(pool.map(lambda _: endpoint.post("k-storm", alice), range(50)))

    statuses = sorted({a.status_code for a in answers})
    created = [a for a in answers if a.status_code == 201]
    assert set(statuses) <= {201, 409}, [a.text for a in answers if a.status_code not in (201, 409)]
    assert created
    assert len({a.content for a in created}) == 1  # every 201 is the same response
    assert endpoint.shop.rows(alice) == 1


def test_principals_are_isolated(endpoint: Endpoint) -> None:
    alice, bob = who(), who()
    mine = endpoint.post("k-1", alice)
    theirs = endpoint.post("k-1", bob)

    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert "idempotent-replayed" not in theirs.headers
    assert mine.json()["id"] != theirs.json()["id"]
    assert (endpoint.shop.rows(alice), endpoint.shop.rows(bob)) == (1, 1)


def test_400_and_401_are_never_recorded(endpoint: Endpoint) -> None:
    """No key, no principal, or a body the view's validation refuses: nothing is claimed,
    so the corrected request with the same key is a first execution, not a 422."""
    alice = who()
    missing = endpoint.post(None, alice)
    anonymous = endpoint.post("k-1", None)
    invalid = endpoint.post("k-1", alice, b'{"amount": -5}')

    assert missing.status_code == 400
    assert missing.json()["type"].endswith("/missing-key")
    assert anonymous.status_code == 401
    assert invalid.status_code == 400
    if endpoint.path == "/mw/payments":
        # The middleware claims before the view validates: the view's exception releases
        # the key (the 400 is not stored), which stays bound to the refused body.
        assert endpoint.shop.state(alice) == "released"
        again = endpoint.post("k-1", alice, b'{"amount": -5}')
        assert (again.status_code, "idempotent-replayed" in again.headers) == (400, False)
        return
    assert endpoint.shop.key_rows(alice) == 0
    assert endpoint.post("k-1", alice).status_code == 201
    assert endpoint.shop.rows(alice) == 1


def test_a_body_cut_short_is_never_claimed_run_or_recorded(
    endpoint: Endpoint,
) -> None:
    """A client that declares its body and hangs up part-way (what arrived is valid JSON:
    only its length tells): a 400 ``incomplete-body`` problem, nothing claimed, run or
    recorded, whatever the door (the view or the middleware, Django's or Flask's); the whole
    request under the same key is then a first execution, run once, not a 422."""
    alice = who()
    headers = {"Content-Type": "application/json", "Idempotency-Key": "k-1", "X-User": alice}
    # What arrives is valid JSON too: only the length can tell the body was cut short.
    body = b'{"amount": 10}\n\n'
    base, path = endpoint.shop.base, endpoint.path
    cut = send_partial(base, path, headers, declared=len(body), sent=body[:-1])
    assert cut.startswith(b"HTTP/1.1 400"), cut  # the server saw the hang-up and answered
    assert b"/problems/incomplete-body" in cut
    assert endpoint.shop.key_rows(alice) == 0
    assert endpoint.shop.rows(alice) == 0
    first = endpoint.post("k-1", alice, body)
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    assert endpoint.shop.rows(alice) == 1


def test_a_malformed_key_is_a_400_problem_never_claimed_or_run(endpoint: Endpoint) -> None:
    """Every malformed key of the table the ASGI edge is held to (empty, over 255
    characters, 8,000 of them, non-ASCII, a tab, a list, parameters, a broken
    structured-field string, two header lines, which gunicorn joins into a list): the
    400 invalid-key problem, nothing claimed or run. A control character gunicorn refuses
    itself (its own 400): the request never reaches the door. The same key as a
    structured-field string (``"k-1"``) is the bare key's: a replay."""
    alice = who()
    url = endpoint.shop.base + endpoint.path
    sent = [("content-type", "application/json"), ("x-user", alice)]

    def post(lines: tuple[bytes, ...]) -> Any:
        headers = [*sent, *((b"idempotency-key", line) for line in lines)]
        return httpx.post(url, content=b'{"amount": 10}', headers=headers, verify=PLAIN_HTTP)

    for name, lines in MALFORMED_KEYS.items():
        refused = post(lines)
        assert refused.status_code == 400, (name, refused.text)
        assert refused.headers["content-type"] == "application/problem+json", name
        assert refused.json()["type"].endswith("/invalid-key"), name
    for name, lines in CONTROL_KEYS.items():
        assert post(lines).status_code == 400, name  # gunicorn's own answer
    assert (endpoint.shop.key_rows(alice), endpoint.shop.rows(alice)) == (0, 0)

    quoted, bare = post((b'"k-1"',)), post((b"k-1",))
    assert quoted.status_code == 201, quoted.text
    assert (bare.status_code, bare.headers["idempotent-replayed"]) == (201, "true")
    assert endpoint.shop.rows(alice) == 1


def test_a_content_length_over_the_cap_is_a_413_before_anything_is_claimed(
    endpoint: Endpoint,
) -> None:
    """A head declaring 100 MB, no body behind it: the 413 body-too-large problem at once
    (the answer can only come before the body: none is sent), nothing claimed or run."""
    alice = who()
    headers = {"Content-Type": "application/json", "Idempotency-Key": "k-1", "X-User": alice}
    answer = post_declaring(endpoint.shop.base, endpoint.path, headers, length=100_000_000)

    assert answer.status == 413
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/body-too-large")
    assert (endpoint.shop.key_rows(alice), endpoint.shop.rows(alice)) == (0, 0)


def test_a_transient_503_is_released_and_the_retry_really_runs(endpoint: Endpoint) -> None:
    alice = who()
    failed = endpoint.post("k-1", alice, x_fail="503")

    assert failed.status_code == 503
    assert endpoint.shop.rows(alice) == 0  # rolled back with the release
    assert endpoint.shop.state(alice) == "released"
    retry = endpoint.post("k-1", alice)
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert endpoint.shop.rows(alice) == 1


def test_the_django_middleware_refuses_to_start_before_authentication(tmp_path: Path) -> None:
    """A wiring mistake fails the server's start, not each request."""
    cwd = EXAMPLES / "django_app"
    env = _env(f"sqlite:///{tmp_path / 'shop.db'}")
    script = (
        "import django, os\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = 'shop.settings'\n"
        "from django.conf import settings\n"
        "django.setup()\n"
        "m = settings.MIDDLEWARE\n"
        "settings.MIDDLEWARE = [m[-1], *m[:-1]]\n"
        "from django.core.wsgi import get_wsgi_application\n"
        "get_wsgi_application()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr
    assert "placed before" in done.stderr


@pytest.mark.parametrize("path", ["/cbv/payments", "/drf/payments"])
def test_sqlite_under_atomic_requests_protects_function_views_and_refuses_methods(
    servers: Servers, path: str
) -> None:
    """ATOMIC_REQUESTS on SQLite: a decorated function view opts out of the request's
    transaction and works; a method runs inside it, where one writer cannot claim and
    give keys back, so it is refused with a 500 problem naming the fix, key released."""
    shop = servers.get("django-atomic", "sqlite")
    alice = who()
    assert Endpoint(shop, "/payments").post("k-1", alice).status_code == 201

    refused = Endpoint(shop, path).post("k-2", alice)

    assert refused.status_code == 500
    assert refused.headers["content-type"] == "application/problem+json"
    assert "SQLite admits one writer" in refused.json()["detail"]
    assert shop.rows(alice) == 1


@pytest.mark.postgres
def test_a_pool_of_one_per_worker_serves_every_door_at_once(servers: Servers) -> None:
    """Django's psycopg pool of one connection per worker, ``ATOMIC_REQUESTS=True`` (the
    class-based view and the DRF action run inside the request's transaction), sixteen
    threads: 96 concurrent requests, 48 keys sent twice each across the four doors. A
    request holds one pooled connection at most (the claim runs on the connection the
    request's transaction uses), so the pool is big enough: every request is a 201 or,
    for a duplicate still running, a 409 with Retry-After; each key charged once, never a
    500 or a 503. Before: the claim of a CBV or DRF request took a second connection of the
    same pool (and kept it for its thread), so requests waited out the pool's timeout
    holding one, and answered 500s and 503s."""
    shop = servers.get("django-pool", "postgres")
    alice = who()
    sends = [(path, f"k-{i}-{path}") for path in DJANGO_PATHS for i in range(12)] * 2

    def send(sent: tuple[str, str]) -> Any:
        try:
            return Endpoint(shop, sent[0]).post(sent[1], alice)
        except httpx.TimeoutException as exc:  # a request stuck behind the pool
            return exc

    with ThreadPoolExecutor(max_workers=len(sends)) as pool:
        answers = list(pool.map(send, sends))

    unexpected = [
        repr(a) if isinstance(a, Exception) else (a.status_code, a.text[:120])
        for a in answers
        if isinstance(a, Exception) or a.status_code not in (201, 409)
    ]
    assert not unexpected, unexpected
    busy = [a for a in answers if a.status_code == 409]
    assert all(int(a.headers["retry-after"]) >= 1 for a in busy)
    created = {sent[1] for sent, a in zip(sends, answers, strict=True) if a.status_code == 201}
    assert len(created) == len(sends) // 2  # every key answered 201 at least once
    assert shop.rows(alice) == len(sends) // 2  # each charged exactly once
    assert shop.key_rows(alice) == len(sends) // 2


def _chunked_until_answered(base: str, path: str, headers: dict[str, str], most: int) -> Any:
    """POST a chunked body of up to ``most`` bytes, 64 KiB a chunk, until the server answers.

    Returns the bytes of body sent before the answer was readable, and the answer's start.
    """
    import select
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(base)
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n{lines}Transfer-Encoding: chunked\r\n"
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    sent = 0
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(f"{head}Connection: close\r\n\r\n".encode())
        while sent < most and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed
                break
            sent += 65536
        answer = b""
        while len(answer) < 4096 and (data := sock.recv(4096)):
            answer += data
    return sent, answer


#: A body without its length, through every door: Flask's and the Django shop's four
#: (SQLite and PostgreSQL).
_CHUNKED = [
    p for p in ENDPOINTS if str(p.id).startswith(("flask", "django-sqlite", "django-postgres"))
]


@pytest.mark.parametrize("endpoint", _CHUNKED, indirect=True)
def test_a_chunked_body_past_the_cap_is_a_413_read_no_further(endpoint: Endpoint) -> None:
    """A chunked body (no Content-Length) of up to 300 MiB: the 413 body-too-large problem
    once the cap (1 MiB, lowered to the frameworks' own, 512 KiB, on these shops) is
    passed, nothing claimed or recorded, the body read no further than the cap and what
    the sockets buffer. Before: Werkzeug read all 300 MiB into memory, then the 413; Django
    saw an empty body (no CONTENT_LENGTH): the views' 400, and the middleware claimed the
    key for it and left it released."""
    alice = who()
    headers = {"Content-Type": "application/json", "Idempotency-Key": "k-1", "X-User": alice}
    sent, answer = _chunked_until_answered(endpoint.shop.base, endpoint.path, headers, 300 * 2**20)

    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"/problems/body-too-large" in answer
    assert sent < 8 * 2**20  # the cap, plus what the sockets' buffers took
    assert endpoint.shop.key_rows(alice) == 0


@pytest.mark.parametrize("endpoint", _CHUNKED, indirect=True)
def test_a_chunked_body_under_the_cap_is_served_as_with_its_length(endpoint: Endpoint) -> None:
    """A small chunked body (no Content-Length) is the request's body, as with a length:
    201, a replay of the same chunked body, and the same bytes with a Content-Length
    replay too (the fingerprint is of the body, not of its framing). Before: Django saw
    an empty body (no CONTENT_LENGTH): the views' 400, the middleware's key claimed for
    it and released, so the real request under that key was a 422."""
    alice = who()
    body = b'{"amount": 10}'

    def chunked() -> Iterator[bytes]:  # httpx sends an iterator chunked, without a length
        yield body[:5]
        yield body[5:]

    first = endpoint.post("k-1", alice, chunked(), connection="close")
    again = endpoint.post("k-1", alice, chunked(), connection="close")
    sized = endpoint.post("k-1", alice, body, connection="close")

    assert first.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in first.request.headers
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    for replay in (again, sized):
        assert (replay.status_code, replay.content) == (201, first.content), replay.text
        assert replay.headers["idempotent-replayed"] == "true"
    assert endpoint.shop.rows(alice) == 1


@pytest.mark.parametrize("endpoint", _CHUNKED, indirect=True)
def test_the_frameworks_own_body_cap_below_ours_is_the_cap_of_every_door(
    endpoint: Endpoint,
) -> None:
    """The framework's own cap on a body in memory (Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE``,
    Flask's ``MAX_CONTENT_LENGTH``: 512 KiB here) below idemflow's (1 MiB): a 600 KiB body
    the view would accept is the 413 body-too-large problem naming 512 KiB through every
    door, with its Content-Length (before anything is read) and chunked (while it
    streams), nothing claimed, run or recorded; 400 KiB runs. Before: Django with a
    Content-Length answered its own HTML 400 (``RequestDataTooBig``), no problem; chunked,
    Django bypassed its setting (the body read, claimed, run and recorded: 201), and Flask
    ran the view on the first 512 KiB (Werkzeug returns what it read up to the maximum)."""
    alice = who()
    note = b"n" * (600 * 1024)
    body = b'{"amount": 10, "note": "%s"}' % note

    def chunked() -> Iterator[bytes]:  # httpx sends an iterator chunked, without a length
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    sized = endpoint.post("k-1", alice, body, connection="close")
    streamed = endpoint.post("k-1", alice, chunked(), connection="close")
    within = endpoint.post("k-2", alice, body.replace(note, note[: 400 * 1024]))

    for refused in (sized, streamed):
        assert refused.status_code == 413, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"].endswith("/body-too-large")
        assert str(FRAMEWORK_CAP) in refused.json()["detail"]
    assert streamed.request.headers.get("transfer-encoding") == "chunked"
    assert within.status_code == 201, within.text
    assert (endpoint.shop.key_rows(alice), endpoint.shop.rows(alice)) == (1, 1)
