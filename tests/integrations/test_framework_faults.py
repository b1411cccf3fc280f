"""
Faults through the real servers: the Django and Flask example shops under gunicorn
(gthread), killed or outlived in the middle of a request, then resolved by the
sweeper each framework ships.

- **SIGKILL mid-request.** A request has claimed its key and written its payment row
  (uncommitted) when its gunicorn worker — or the whole server, master and workers —
  is killed. The claim stays ``in_progress`` and the row is gone; a sweep before the
  stale threshold leaves it alone; after the threshold the sweeper (``manage.py
  idemflow_sweep``, ``flask idemflow sweep`` or ``idemflow sweep URL``) releases it,
  and the retry runs once: one payment row.
- **A lost lease.** A request overruns the stale threshold with its payment row
  written; the sweeper takes its claim over (and, in one of the two requests, a
  retry completes the key first). When the overrunning request tries to commit, its
  completion is refused (409 lease-lost) and its payment row rolls back with it.
- **SIGTERM mid-request** (gunicorn's graceful stop: the master tells its workers to
  finish the requests in flight within ``--graceful-timeout``, then kills them). A
  request let go once its worker drains finishes: 201, one row, the key completed, and
  after a restart the retry replays. A request held past a 2 s graceful timeout is
  killed with its worker: as SIGKILL, its claim stays ``in_progress`` for the sweeper.
  (A gunicorn config hook, ``gunicorn_term_marks.py``, tells when a worker drains.)
- **The store killed.** The shop runs on a database server of its own: a PostgreSQL
  (initdb, pg_ctl) stopped in immediate mode, or (the Django shop) a MariaDB
  (mariadb-install-db, mariadbd) killed with SIGKILL, under a request whose row is
  written, or before a request arrives: a 503 ``store-unavailable`` problem, never a
  500, nothing committed. A claim committed before the stop stays ``in_progress`` (no
  connection answers its release) until the sweeper; a request refused before its claim
  records nothing, and its retry runs at once. Under a request held before its view's
  first query, that query's error is the view's own: the framework's 500, nothing
  committed, the claim left to the sweeper.

Most scenarios need a claim older than the stale threshold (2 × request timeout +
10 s: 16 s with the 3 s request timeout the servers get here), so the scenarios
are *staged*: when the module starts, one server per scenario is started, all at
once in threads; once every one is up, one stager thread runs each scenario's
first phase (the request sent, then killed or held, and the early sweep) in test
order. Each test then waits for its own claims to age, sweeps and checks. The
module waits for one stale threshold, not one per test (the drained SIGTERM and the
request refused before its claim wait for none: their tests run whole, on servers
started with the others); and as the first phases run one at a time, after the
start-ups, none competes with the others for the two cores, which had pushed early
sweeps past their claims' threshold.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from unittest import mock

import pytest

from tests._private_mariadb import PrivateMariaDB, PrivateMariaDBUnavailable
from tests._private_postgres import PrivatePostgres, PrivatePostgresUnavailable
from tests.conftest import selected_in_module, unreachable
from tests.integrations import gunicorn_term_marks
from tests.integrations.gunicorn_term_marks import term_mark
from tests.integrations.test_wsgi_apps import (
    _MARKS,
    EXAMPLES,
    PLAIN_HTTP,
    Shop,
    _django_shop,
    _env,
    _flask_shop,
    _gunicorn,
    who,
)

httpx = pytest.importorskip("httpx")

from idemflow import Policy  # noqa: E402
from idemflow.stores.mysql._statements import SERVER_NOW_MS as MYSQL_NOW_MS  # noqa: E402
from idemflow.stores.postgres import SERVER_NOW_MS as POSTGRES_NOW_MS  # noqa: E402

pytestmark = pytest.mark.slow

#: The servers' request timeout: the stale threshold derived from it is 16 s, room for
#: a loaded machine to stage every scenario (start, send, kill, run manage.py) well
#: before it, so the early sweep is early.
REQUEST_TIMEOUT = 3.0
STALE_AFTER = Policy(request_timeout=REQUEST_TIMEOUT).stale_seconds
#: How long a held request may wait for its gate: past any test's wait, on a loaded
#: machine too (the tests before it, then its own threshold); the gate opens it sooner.
HOLD_LIMIT = 180
SERVER_ENV = {"SHOP_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT), "SHOP_HOLD_LIMIT": str(HOLD_LIMIT)}
#: The longest a test waits for a claim to age past the threshold (staging included).
AGE_DEADLINE = STALE_AFTER + 60
TERM_MARKS_CONFIG = Path(gunicorn_term_marks.__file__)
_MASTER = re.compile(r"Listening at: http://127\.0\.0\.1:\d+ \((\d+)\)")


@dataclass(frozen=True)
class Case:
    """One scenario on one example shop: its own server and database."""

    scenario: str  # "kill-worker", "kill-server" or "overrun"
    app: str  # "django" or "flask"
    vendor: str  # "postgres" or "mysql"
    path: str
    sweeper: str  # "command" (manage.py idemflow_sweep / flask idemflow sweep) or "cli"

    @property
    def id(self) -> str:
        if self.sweeper == "cli":
            sweeper = "idemflow-sweep-URL"
        else:
            sweeper = "manage.py-idemflow_sweep" if self.app == "django" else "flask-idemflow-sweep"
        return f"{self.scenario}-{self.app}-{self.vendor}{self.path}-{sweeper}"


KILL_CASES = [
    Case("kill-worker", "django", "postgres", "/drf/payments", "command"),
    Case("kill-worker", "django", "mysql", "/drf/payments", "command"),
    Case("kill-worker", "flask", "postgres", "/payments", "command"),
    Case("kill-server", "django", "postgres", "/payments", "cli"),
    Case("kill-server", "flask", "postgres", "/payments", "cli"),
]


def _on_both_shops(scenario: str) -> list[Case]:
    """``scenario`` through Django's DRF view and Flask's, both on PostgreSQL."""
    return [
        Case(scenario, "django", "postgres", "/drf/payments", "command"),
        Case(scenario, "flask", "postgres", "/payments", "command"),
    ]


#: SIGTERM to the master while a request is held: released within the graceful timeout
#: (it finishes), or held past it (its worker is killed).
DRAINED_CASES = [
    *_on_both_shops("sigterm-drained"),
    Case("sigterm-drained", "django", "mysql", "/payments", "command"),
]
PAST_GRACE_CASES = [
    *_on_both_shops("sigterm-past-grace"),
    Case("sigterm-past-grace", "django", "mysql", "/payments", "command"),
]
#: A private database server killed under the shop: PostgreSQL (stopped in immediate
#: mode) or MariaDB (SIGKILL).
STORE_CASES = [
    *_on_both_shops("store-killed"),
    Case("store-killed", "django", "mysql", "/drf/payments", "command"),
]
OVERRUN_CASES = [
    Case("overrun", "django", "postgres", "/drf/payments", "command"),
    Case("overrun", "django", "postgres", "/mw/payments", "command"),
    Case("overrun", "django", "mysql", "/payments", "command"),
    Case("overrun", "flask", "postgres", "/payments", "command"),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, marks=_MARKS[c.vendor], id=c.id) for c in cases]


# --- servers -------------------------------------------------------------------------


class PrivateDatabase(Protocol):
    """A database server of the case's own, which it kills and starts again on the same
    port and data (:class:`PrivatePostgres`, :class:`PrivateMariaDB`)."""

    port: int

    @property
    def url(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class Server:
    """An example shop started for one case, and how to reach its processes."""

    case: Case
    shop: Shop
    log: Path
    tmp: Path
    stack: contextlib.ExitStack  # the case's own: its servers and database
    gunicorn: dict[str, Any] = field(default_factory=dict)  # _gunicorn's options
    database: PrivateDatabase | None = None  # the case's own database server, if it kills it

    @property
    def cwd(self) -> Path:
        return EXAMPLES / ("django_app" if self.case.app == "django" else "flask_app")

    def env(self) -> dict[str, str]:
        env = _env(self.shop.url)
        env["SHOP_ATOMIC_REQUESTS"] = "0"
        return env

    def master(self) -> int:
        found = _MASTER.search(self.log.read_text())
        assert found is not None, self.log.read_text()
        return int(found.group(1))

    def workers(self) -> list[int]:
        return _children(self.master())

    def restart(self) -> None:
        """A new server on the same database (after the old one was killed)."""
        app = "shop.wsgi" if self.case.app == "django" else "app:app"
        self.log = self.tmp / f"gunicorn-{time.monotonic_ns()}.log"
        server = _gunicorn(app, self.cwd, self.env(), self.log, **self.gunicorn)
        self.shop.base = self.stack.enter_context(server)

    def sweep(self) -> int:
        """One pass of the case's sweeper: how many claims it released."""
        if self.case.sweeper == "cli":
            args = [sys.executable, "-m", "idemflow", "sweep", self.shop.url, "--json"]
            args += ["--request-timeout", str(REQUEST_TIMEOUT)]
        elif self.case.app == "django":
            args = [sys.executable, "manage.py", "idemflow_sweep"]
        else:
            args = [sys.executable, "-m", "flask", "--app", "app", "idemflow", "sweep"]
        done = subprocess.run(
            args,
            check=False,
            cwd=self.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        if self.case.sweeper == "cli":
            return int(json.loads(done.stdout.strip().splitlines()[-1])["released"])
        found = re.search(r"released=(\d+)", done.stdout)
        assert found is not None, done.stdout
        return int(found.group(1))

    def age_ms(self, principal: str) -> float:
        """How old the principal's claim is, on the database's clock (the sweeper's)."""
        now = POSTGRES_NOW_MS if self.case.vendor == "postgres" else MYSQL_NOW_MS
        sql = f"SELECT {now} - updated_at FROM {self.shop.key_table} WHERE principal = %s"
        return float(self.shop._query(sql, principal))

    def wait_until_stale(self, *principals: str) -> None:
        """Poll the key table until every claim is past the stale threshold (deadline)."""
        deadline = time.monotonic() + AGE_DEADLINE
        while min(self.age_ms(p) for p in principals) <= STALE_AFTER * 1000 + 100:
            assert time.monotonic() < deadline, "the claims never aged past the threshold"
            time.sleep(0.2)  # polling the key table with a deadline


#: The SIGTERM cases' graceful timeouts: room for a released request to finish on a
#: loaded machine; a short one for the request held past it.
DRAIN_GRACE, PAST_GRACE = 20, 2  # whole seconds: gunicorn takes integers


def _start(case: Case, tmp: Path, stack: contextlib.ExitStack) -> Server:
    gunicorn: dict[str, Any] = {}
    if case.scenario.startswith("sigterm"):
        grace = DRAIN_GRACE if case.scenario == "sigterm-drained" else PAST_GRACE
        gunicorn = {"graceful_timeout": grace, "config": TERM_MARKS_CONFIG}
    database = None
    if case.scenario == "store-killed":
        database = _private_database(case.vendor)
        stack.callback(database.close)  # after the server stops (the stack unwinds in reverse)
        database.start()
    options: dict[str, Any] = {"gunicorn": gunicorn}
    if database is not None:
        options["database"] = database.url
    if case.app == "django":
        shop = _django_shop(case.vendor, tmp, stack, **options)
    else:
        shop = _flask_shop(case.vendor, tmp, stack, **options)
    return Server(case, shop, tmp / "gunicorn.log", tmp, stack, gunicorn, database)


def _private_database(vendor: str) -> PrivateDatabase:
    """A private server of ``vendor``, not started; missing tools skip its tests, or fail
    them under CI (:func:`~tests.conftest.unreachable`)."""
    try:
        return PrivatePostgres() if vendor == "postgres" else PrivateMariaDB()
    except (PrivatePostgresUnavailable, PrivateMariaDBUnavailable) as exc:
        unreachable(f"a private {'PostgreSQL' if vendor == 'postgres' else 'MariaDB'}", exc)
        raise


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid …: comm may hold spaces, so split after its ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return found


def _post(server: Server, key: str, principal: str, **headers: str) -> Any:
    sent = {"content-type": "application/json", "idempotency-key": key, "x-user": principal}
    sent.update({k.replace("_", "-"): v for k, v in headers.items()})
    url = server.shop.base + server.case.path
    body, timeout = b'{"amount": 10}', HOLD_LIMIT + 30
    return httpx.post(url, content=body, headers=sent, timeout=timeout, verify=PLAIN_HTTP)


@dataclass
class Held:
    """A request kept running inside its view, after its payment row was written (or, with
    ``before_write``, before the view's first statement)."""

    principal: str
    gate: Path
    answers: list[Any] = field(default_factory=list)
    thread: threading.Thread | None = None
    before_write: bool = False

    def send(self, server: Server, key: str) -> None:
        """Send it, and return once it waits at its hold. Sent again while it is answered a
        503 ``store-unavailable`` first (at most ``DEAD_CONNECTIONS`` times): after a
        restart of the store, a kept connection that died fails the request that takes
        it, before its claim (see :func:`_post_once_the_store_is_back`)."""
        hold = "x_hold" if self.before_write else "x_hold_after_write"
        gate = str(self.gate)

        def run() -> None:
            try:
                self.answers.append(_post(server, key, self.principal, **{hold: gate}))
            except httpx.TransportError as exc:  # the server was killed under it
                self.answers.append(exc)

        for _ in range(DEAD_CONNECTIONS):
            self.answers.clear()
            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()
            _wait_for(
                lambda: Path(f"{gate}.waiting").exists() or bool(self.answers),
                "the request never reached its hold",
            )
            if not self.answers:
                return
            _assert_store_unavailable(self.answers[0])  # refused before its claim: again
        raise AssertionError("the request never reached its hold")

    def release(self) -> Any:
        """Open the gate; the request's answer."""
        assert self.thread is not None
        self.gate.touch()
        self.thread.join(timeout=HOLD_LIMIT + 30)
        assert self.answers, "the held request never answered"
        return self.answers[0]


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling with a deadline


# --- staging: every case's first phase, at once -----------------------------------------


@dataclass
class Killed:
    server: Server
    principal: str
    key: str
    killed: list[int]
    answer: Any
    state_after_kill: str | None
    rows_after_kill: int
    released_before_threshold: int
    state_after_early_sweep: str | None


@dataclass
class Overrun:
    server: Server
    alone: Held  # resumes after the sweep, with no retry in between
    overtaken: Held  # a retry takes its key over and completes before it resumes
    key: str


def _kill_mid_request(server: Server) -> Killed:
    held, key = Held(who(), server.tmp / "never-opened"), "k-crash"
    held.send(server, key)
    victims = server.workers()  # every worker: the one running the request is among them
    if server.case.scenario == "kill-server":
        victims = [server.master(), *victims]  # the master first: it must not respawn
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert held.thread is not None
    held.thread.join(timeout=30)
    _wait_for(lambda: not _live(victims), "the killed processes linger")
    state = server.shop.state(held.principal)
    rows = server.shop.rows(held.principal)
    released = server.sweep()  # well before the threshold: must leave the claim alone
    return Killed(
        server,
        held.principal,
        key,
        victims,
        held.answers[0] if held.answers else None,
        state,
        rows,
        released,
        server.shop.state(held.principal),
    )


def _live(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
    return alive


def _overrun(server: Server) -> Overrun:
    tmp = server.tmp
    alone, overtaken = Held(who(), tmp / "gate-alone"), Held(who(), tmp / "gate-overtaken")
    key = "k-slow"
    alone.send(server, key)
    overtaken.send(server, key)
    return Overrun(server, alone, overtaken, key)


@dataclass
class PastGrace:
    server: Server
    principal: str
    key: str
    answer: Any
    state_after_stop: str | None
    rows_after_stop: int
    released_before_threshold: int
    state_after_early_sweep: str | None


def _sigterm_past_grace(server: Server) -> PastGrace:
    """SIGTERM to the master while a request is held past the graceful timeout."""
    held, key = Held(who(), server.tmp / "never-opened"), "k-term"
    held.send(server, key)
    gone = [server.master(), *server.workers()]
    os.kill(gone[0], signal.SIGTERM)
    assert held.thread is not None
    held.thread.join(timeout=PAST_GRACE + 60)
    _wait_for(lambda: not _live(gone), "gunicorn outlived its graceful timeout")
    state, rows = server.shop.state(held.principal), server.shop.rows(held.principal)
    released = server.sweep()  # well before the threshold: must leave the claim alone
    return PastGrace(
        server,
        held.principal,
        key,
        held.answers[0] if held.answers else None,
        state,
        rows,
        released,
        server.shop.state(held.principal),
    )


@dataclass
class StoreKilled:
    server: Server
    principal: str
    key: str
    answer: Any  # the held request's, released while its store was down
    state_after_restart: str | None
    rows_after_restart: int
    released_before_threshold: int
    state_after_early_sweep: str | None
    #: The same, for a request held before its view's first statement (the view's own
    #: query then meets the dead connection).
    before_write: StoreKilled | None = None
    #: Its retry with the store back, before the threshold (staged: before any sweep).
    retry_before_threshold: Any = None


def _store_killed_mid_request(server: Server) -> StoreKilled:
    """The private database server stopped (PostgreSQL: immediate mode; MariaDB: SIGKILL)
    under a request whose row is written; then, on the same server, under one held before
    its view's first statement."""
    after_write = _store_killed_under(server, Held(who(), server.tmp / "gate-store"), "k-store")
    early = Held(who(), server.tmp / "gate-store-early", before_write=True)
    # No early sweep this time: the first claim is nearly as old as the threshold by now
    # (a stop and a restart of the database each), and the first sweep proved the rule.
    after_write.before_write = _store_killed_under(server, early, "k-store-early", sweep=False)
    retry = _post_once_the_store_is_back(server, "k-store-early", early.principal)
    after_write.before_write.retry_before_threshold = retry
    return after_write


def _store_killed_under(server: Server, held: Held, key: str, sweep: bool = True) -> StoreKilled:
    assert server.database is not None
    held.send(server, key)
    server.database.stop()
    answer = held.release()
    server.database.start()
    state, rows = server.shop.state(held.principal), server.shop.rows(held.principal)
    released = server.sweep() if sweep else 0  # well before the threshold
    return StoreKilled(
        server,
        held.principal,
        key,
        answer,
        state,
        rows,
        released,
        server.shop.state(held.principal),
    )


#: Each scenario's first phase, run by the stager (the drained SIGTERM needs none: its
#: test runs it whole, as it waits for no threshold).
_STAGED: dict[str, Callable[[Server], Any]] = {
    "kill-worker": _kill_mid_request,
    "kill-server": _kill_mid_request,
    "overrun": _overrun,
    "sigterm-past-grace": _sigterm_past_grace,
    "store-killed": _store_killed_mid_request,
    "sigterm-drained": lambda server: server,
}


class Stages:
    """Every selected case's server, started together; their first phases, in turn."""

    def __init__(self, cases: list[Case], tmp: pytest.TempPathFactory) -> None:
        self._starter = ThreadPoolExecutor(max_workers=max(1, len(cases)))
        self._stager = ThreadPoolExecutor(max_workers=1)
        self._lock = threading.Lock()
        self._stacks: list[contextlib.ExitStack] = []
        self._futures: dict[Case, Future[Any]] = {}
        servers = {c: self._starter.submit(self._start, c, tmp.mktemp(c.scenario)) for c in cases}
        for case in cases:  # in test order: the first test's claim is made first
            self._futures[case] = self._stager.submit(self._stage, case, servers)

    def get(self, case: Case) -> Any:
        return self._futures[case].result(timeout=300)

    def close(self) -> None:
        """Stop every case's servers and drop its database, all at once (each takes a
        graceful gunicorn shutdown and a DROP DATABASE)."""
        self._starter.shutdown(wait=True)
        self._stager.shutdown(wait=True)
        if self._stacks:
            with ThreadPoolExecutor(max_workers=len(self._stacks)) as stopping:
                list(stopping.map(contextlib.ExitStack.close, self._stacks))

    def _start(self, case: Case, tmp: Path) -> Server:
        own = contextlib.ExitStack()
        with self._lock:
            self._stacks.append(own)  # stopped when the module ends, in any case
        return _start(case, tmp, own)

    @staticmethod
    def _stage(case: Case, servers: dict[Case, Future[Server]]) -> Any:
        wait(servers.values(), timeout=180)  # every one is up (or failed: its own test says)
        server = servers[case].result(timeout=0)
        return _STAGED[case.scenario](server)


def _case_of(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    found = None if callspec is None else callspec.params.get("case")
    return found if isinstance(found, Case) else None


@pytest.fixture(scope="module")
def stages(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stages]:
    """Only the cases selected in this run are staged (``-k``, ``-m 'not mysql'``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, SERVER_ENV))
        staged = Stages(selected_in_module(request, _case_of), tmp_path_factory)
        stack.callback(staged.close)
        yield staged


# --- the tests -------------------------------------------------------------------------


@pytest.mark.parametrize("case", _params(KILL_CASES))
def test_a_sigkill_mid_request_is_swept_after_the_threshold_and_the_retry_runs_once(
    case: Case, stages: Stages
) -> None:
    crash: Killed = stages.get(case)
    server, alice = crash.server, crash.principal

    assert crash.killed, "no gunicorn process to kill"
    assert isinstance(crash.answer, httpx.TransportError), crash.answer  # no answer at all
    assert crash.state_after_kill == "in_progress"
    assert crash.rows_after_kill == 0  # the uncommitted payment died with the process
    assert (crash.released_before_threshold, crash.state_after_early_sweep) == (0, "in_progress")
    if case.scenario == "kill-server":
        server.restart()
    blocked = _post(server, crash.key, alice)
    assert blocked.status_code == 409  # until the sweeper resolves it

    server.wait_until_stale(alice)
    assert server.sweep() == 1
    assert server.shop.state(alice) == "released"
    retry = _post(server, crash.key, alice)
    replay = _post(server, crash.key, alice)

    assert retry.status_code == 201, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert replay.headers["idempotent-replayed"] == "true"
    assert server.shop.rows(alice) == 1
    if case.scenario == "kill-worker":
        assert set(server.workers()).isdisjoint(crash.killed)  # the master replaced them


@pytest.mark.parametrize("case", _params(OVERRUN_CASES))
def test_a_request_that_outlives_its_lease_cannot_commit_its_row_or_its_completion(
    case: Case, stages: Stages
) -> None:
    """Two requests overrun the threshold with their payment rows written; the sweeper
    takes both claims over, and a retry completes the second key before its first owner
    resumes. Neither late owner commits: not its completion, not its payment row."""
    slow: Overrun = stages.get(case)
    server, alone, overtaken = slow.server, slow.alone, slow.overtaken
    principals = (alone.principal, overtaken.principal)
    assert [server.shop.state(p) for p in principals] == ["in_progress"] * 2

    server.wait_until_stale(*principals)
    assert server.sweep() == 2
    assert [server.shop.state(p) for p in principals] == ["released"] * 2
    retry = _post(server, slow.key, overtaken.principal)  # the new owner, while the old runs
    assert retry.status_code == 201, retry.text
    late = [alone.release(), overtaken.release()]

    for answer in late:
        assert answer.status_code == 409, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["type"].endswith("/lease-lost")
    assert server.shop.rows(alone.principal) == 0  # rolled back with the refused completion
    assert server.shop.state(alone.principal) == "released"
    assert server.shop.rows(overtaken.principal) == 1  # the retry's; the late one's rolled back
    replay = _post(server, slow.key, overtaken.principal)
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert replay.headers["idempotent-replayed"] == "true"
    again = _post(server, slow.key, alone.principal)  # the released key: its retry runs once
    assert again.status_code == 201, again.text
    assert "idempotent-replayed" not in again.headers
    assert server.shop.rows(alone.principal) == 1


@pytest.mark.parametrize("case", _params(DRAINED_CASES))
def test_a_request_in_flight_at_sigterm_finishes_within_the_graceful_timeout(
    case: Case, stages: Stages
) -> None:
    """SIGTERM to the master while a request is held with its payment row written; once
    every worker is draining (it accepts nothing more), the request is let go within the
    graceful timeout: it commits its row and its completion together and the client gets
    its 201. After a restart, the retry is the stored replay, with no second row."""
    server: Server = stages.get(case)
    held, key = Held(who(), server.tmp / "gate-drained"), "k-drained"
    held.send(server, key)
    workers = server.workers()
    os.kill(server.master(), signal.SIGTERM)
    draining = [term_mark(server.log, pid) for pid in workers]
    _wait_for(lambda: all(mark.exists() for mark in draining), "no worker began to drain")
    answer = held.release()
    _wait_for(lambda: not _live([server.master(), *workers]), "gunicorn did not stop")

    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 201, answer.text
    assert "idempotent-replayed" not in answer.headers
    assert server.shop.state(held.principal) == "completed"
    assert server.shop.rows(held.principal) == 1
    server.restart()
    replay = _post(server, key, held.principal)
    assert (replay.status_code, replay.content) == (201, answer.content)
    assert replay.headers["idempotent-replayed"] == "true"
    assert server.shop.rows(held.principal) == 1


@pytest.mark.parametrize("case", _params(PAST_GRACE_CASES))
def test_a_request_held_past_the_graceful_timeout_is_killed_and_stays_claimed(
    case: Case, stages: Stages
) -> None:
    """SIGTERM to the master while a request is held past the graceful timeout (2 s): the
    master kills its worker, the client gets no answer, the payment row dies uncommitted
    and the claim stays ``in_progress`` (nothing of ours released it: the outcome is
    unknown). A retry gets 409 with Retry-After, an early sweep leaves the claim alone;
    past the threshold the sweeper releases it and the retry runs once: one row."""
    stopped: PastGrace = stages.get(case)
    server, alice = stopped.server, stopped.principal

    assert isinstance(stopped.answer, httpx.TransportError), stopped.answer  # never answered
    assert (stopped.state_after_stop, stopped.rows_after_stop) == ("in_progress", 0)
    assert (stopped.released_before_threshold, stopped.state_after_early_sweep) == (
        0,
        "in_progress",
    )
    server.restart()
    blocked = _post(server, stopped.key, alice)
    assert blocked.status_code == 409, blocked.text
    assert int(blocked.headers["retry-after"]) >= 1

    server.wait_until_stale(alice)
    assert server.sweep() == 1
    retry = _post(server, stopped.key, alice)
    replay = _post(server, stopped.key, alice)

    assert retry.status_code == 201, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert server.shop.rows(alice) == 1


def _assert_store_unavailable(answer: Any) -> None:
    assert not isinstance(answer, Exception), answer
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/store-unavailable"), answer.text
    assert int(answer.headers["retry-after"]) >= 1


#: The most store connections that can die with the database: a key store's pool in
#: each of two workers (PostgresStore's default size, 16), or the Django shop's side
#: connections on MariaDB (one per thread: two workers of 8), and one more request.
DEAD_CONNECTIONS = 2 * 16 + 1


def _post_once_the_store_is_back(server: Server, key: str, principal: str) -> Any:
    """``_post``, sent again while it is a 503 ``store-unavailable`` problem (at most
    ``DEAD_CONNECTIONS`` times).

    A store connection kept between requests that died with the database fails the one
    request that next takes it, and is dropped: a 503 with nothing recorded, which a
    client retries as any 503. (The Flask shop's key store claims on its engine's pool,
    whose pre-ping replaces a dead connection before a claim gets it: none there.) The
    Django shop on MariaDB claims on a side connection each thread keeps
    (``DjangoStore``'s, for its bounded lock waits). On PostgreSQL Django's shop
    connects for each request: its first answer counts."""
    for _ in range(DEAD_CONNECTIONS):
        answer = _post(server, key, principal)
        if answer.status_code != 503:
            return answer
        _assert_store_unavailable(answer)  # never a 500: a dead connection is an outage
    return answer


@pytest.mark.parametrize("case", _params(STORE_CASES))
def test_the_store_killed_mid_request_is_a_503_and_the_claim_waits_for_the_sweeper(
    case: Case, stages: Stages
) -> None:
    """The shop's own database server stopped (PostgreSQL in immediate mode, MariaDB by
    SIGKILL) while a request is held with its payment row written, uncommitted; the
    request let go: its completion cannot be written and no connection answers the
    release (a dead one fails, a new one is refused), so the client gets a 503
    ``store-unavailable`` problem (never a 500), nothing is committed and the claim,
    committed before, stays ``in_progress`` (two-commit: "claimed, and the sweeper
    resolves it"). With the store back, a retry gets 409; past the threshold the sweeper
    releases the claim and the retry runs once: one payment row."""
    killed: StoreKilled = stages.get(case)
    server, alice = killed.server, killed.principal

    _assert_store_unavailable(killed.answer)
    assert (killed.state_after_restart, killed.rows_after_restart) == ("in_progress", 0)
    assert (killed.released_before_threshold, killed.state_after_early_sweep) == (
        0,
        "in_progress",
    )
    blocked = _post_once_the_store_is_back(server, killed.key, alice)
    assert blocked.status_code == 409, blocked.text
    assert int(blocked.headers["retry-after"]) >= 1

    # The request held before its write, on the same server, was claimed just after.
    early = killed.before_write
    assert early is not None
    server.wait_until_stale(alice, early.principal)
    swept = server.sweep()
    assert swept == 2 or (swept == 1 and server.shop.state(early.principal) == "released")
    retry = _post_once_the_store_is_back(server, killed.key, alice)
    replay = _post_once_the_store_is_back(server, killed.key, alice)

    assert retry.status_code == 201, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert replay.headers["idempotent-replayed"] == "true"
    assert server.shop.rows(alice) == 1


@pytest.mark.parametrize("case", _params(STORE_CASES))
def test_a_views_own_query_on_the_dead_store_is_its_own_500_and_the_claim_waits_for_the_sweeper(
    case: Case, stages: Stages
) -> None:
    """The shop's database server stopped while a request is held before its view's first
    statement; let go, the view's own query meets the dead server. That error is the
    view's, as any exception it raises, and passes through unchanged: the framework's 500,
    as the view unprotected would answer. Nothing commits; the release cannot reach the
    store either, so the claim stays ``in_progress`` (never run twice: a retry gets 409)
    until the sweeper releases it past the threshold, and the retry runs once."""
    killed: StoreKilled = stages.get(case)
    assert killed.before_write is not None
    early = killed.before_write
    server, bob = killed.server, early.principal

    assert not isinstance(early.answer, Exception), early.answer
    assert early.answer.status_code == 500, early.answer.text
    assert (early.state_after_restart, early.rows_after_restart) == ("in_progress", 0)
    blocked = early.retry_before_threshold
    assert blocked.status_code == 409, blocked.text
    assert int(blocked.headers["retry-after"]) >= 1

    # The test above sweeps this claim too, past the threshold; run alone, this one does.
    # (Not again once released: a release sets updated_at, the age the wait reads.)
    if server.shop.state(bob) == "in_progress":
        server.wait_until_stale(bob)
        server.sweep()
    assert server.shop.state(bob) == "released"
    retry = _post_once_the_store_is_back(server, early.key, bob)

    assert retry.status_code == 201, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert server.shop.rows(bob) == 1


def _connections_to(pid: int, port: int) -> int:
    """How many established TCP connections process ``pid`` holds to 127.0.0.1:``port``."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                sockets.add(link[len("socket:[") : -1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl, local, remote, state, …, inode (the tenth)
        remote, state, inode = fields[2], fields[3], fields[9]
        count += remote == f"0100007F:{port:04X}" and state == "01" and inode in sockets
    return count


def _warm_every_worker(server: Server) -> None:
    """Requests until every worker keeps two connections of its engine's pool to the store
    (the key store claims on it too), which a restart of the store kills."""
    assert server.database is not None
    port, workers, warm = server.database.port, server.workers(), who()

    def every_one_warm() -> bool:
        return all(_connections_to(pid, port) >= 2 for pid in workers)

    def send(key: str) -> Any:  # a key-store connection the last restart killed may be left
        return _post_once_the_store_is_back(server, key, warm)

    for batch in range(20):
        if every_one_warm():
            return
        keys = [f"warm-{batch}-{n}" for n in range(8)]
        with ThreadPoolExecutor(max_workers=len(keys)) as senders:
            sent = list(senders.map(send, keys))
        assert {answer.status_code for answer in sent} == {201}
    assert every_one_warm(), "a worker never served a request"


@pytest.mark.parametrize("case", _params(STORE_CASES))
def test_a_request_while_the_store_is_down_is_a_503_and_its_retry_runs_once(
    case: Case, stages: Stages
) -> None:
    """A request that arrives while the shop's own database server is stopped: its claim
    cannot be made, so a 503 ``store-unavailable`` problem, the view not run and nothing
    recorded. With the store back, the retry is a first execution, run once. (On the
    server of the test above, with a key of its own: no threshold to wait for.) Every
    Flask worker first keeps pooled connections the restart kills; its engine (the view's
    session's and the key store's) tests a connection before use, so neither the claim
    nor the view gets a dead one: never a 500. (The Django shop on MariaDB keeps a
    side connection per thread for its claims: a dead one is a 503 too.)"""
    server: Server = stages.get(case).server
    assert server.database is not None
    if case.app == "flask":  # its engine's pool keeps connections in every worker
        _warm_every_worker(server)
    alice, key = who(), "k-down"
    server.database.stop()
    try:
        refused = _post(server, key, alice)
    finally:
        server.database.start()

    _assert_store_unavailable(refused)
    assert (server.shop.key_rows(alice), server.shop.rows(alice)) == (0, 0)
    retry = _post_once_the_store_is_back(server, key, alice)
    replay = _post_once_the_store_is_back(server, key, alice)

    assert retry.status_code == 201, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert (replay.status_code, replay.content) == (201, retry.content)
    assert replay.headers["idempotent-replayed"] == "true"
    assert server.shop.rows(alice) == 1
