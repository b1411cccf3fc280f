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

Every scenario needs a claim older than the stale threshold (2 × request timeout +
10 s: 16 s with the 3 s request timeout the servers get here), so the scenarios
are *staged*: when the module starts, one server per scenario is started, all at
once in threads; once every one is up, one stager thread runs each scenario's
first phase (the request sent, then killed or held, and the early sweep) in test
order. Each test then waits for its own claims to age, sweeps and checks. The
module waits for one stale threshold, not one per test; and as the first phases
run one at a time, after the start-ups, none competes with eight others for the
two cores, which had pushed early sweeps past their claims' threshold.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.conftest import selected_in_module
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
from idemflow.stores.mysql import SERVER_NOW_MS as MYSQL_NOW_MS  # noqa: E402
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
OVERRUN_CASES = [
    Case("overrun", "django", "postgres", "/drf/payments", "command"),
    Case("overrun", "django", "postgres", "/mw/payments", "command"),
    Case("overrun", "django", "mysql", "/payments", "command"),
    Case("overrun", "flask", "postgres", "/payments", "command"),
]


def _params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, marks=_MARKS[c.vendor], id=c.id) for c in cases]


# --- servers -------------------------------------------------------------------------


@dataclass
class Server:
    """An example shop started for one case, and how to reach its processes."""

    case: Case
    shop: Shop
    log: Path
    tmp: Path
    stack: contextlib.ExitStack  # the case's own: its servers and database

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
        self.shop.base = self.stack.enter_context(_gunicorn(app, self.cwd, self.env(), self.log))

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


def _start(case: Case, tmp: Path, stack: contextlib.ExitStack) -> Server:
    if case.app == "django":
        shop = _django_shop(case.vendor, tmp, stack)
    else:
        shop = _flask_shop(case.vendor, tmp, stack)
    return Server(case, shop, tmp / "gunicorn.log", tmp, stack)


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
    """A request kept running inside its view, after its payment row was written."""

    principal: str
    gate: Path
    answers: list[Any] = field(default_factory=list)
    thread: threading.Thread | None = None

    def send(self, server: Server, key: str) -> None:
        def run() -> None:
            try:
                self.answers.append(_post(server, key, self.principal, x_hold_after_write=gate))
            except httpx.TransportError as exc:  # the server was killed under it
                self.answers.append(exc)

        gate = str(self.gate)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        _wait_for(lambda: Path(f"{gate}.waiting").exists(), "the request never reached its hold")

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


class Stages:
    """Every selected case's server, started together; their first phases, in turn."""

    def __init__(self, cases: list[Case], tmp: pytest.TempPathFactory) -> None:
        self._starter = ThreadPoolExecutor(max_workers=max(1, len(cases)))
        self._stager = ThreadPoolExecutor(max_workers=1)
        self._lock = threading.Lock()
        self._stacks: list[contextlib.ExitStack] = []
        self._futures: dict[Case, Future[Any]] = {}
        servers = [self._starter.submit(self._start, c, tmp.mktemp(c.scenario)) for c in cases]
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
    def _stage(case: Case, servers: list[Future[Server]]) -> Any:
        started = [server.result(timeout=180) for server in servers]  # every one is up
        server = next(s for s in started if s.case == case)
        return (_overrun if case.scenario == "overrun" else _kill_mid_request)(server)


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
