"""
Pool pressure and faults through the real demo: every key converges, none is poisoned.

The demo shares one small pool between the key store and the endpoints
(PostgreSQL; on SQLite the pool is the endpoints' alone; on MariaDB the store and
the endpoints have a pool each of that size, on Redis the key store's pool and the
SQLite payments' pool). A protected request
takes one pooled connection, and its claim, handler, completion and release
all run on it (counted below, in process), so with a pool of 1 or 2 and 60
keys in flight nothing deadlocks: a provider failing half its calls costs
retries, never a 409 to a client that retries one request at a time, never a
"could not release claim" in the log. A claim the pool cannot serve in its
timeout (a loaded machine) is a 503 with nothing recorded.

Then the demo is stopped mid-load, by SIGTERM (graceful: requests in flight
finish) and by SIGKILL (nothing finishes), on PostgreSQL and MariaDB (both) and
Redis (SIGKILL). Half the clients keep retrying
across the restart, half abandon their key at the first failure. Within the
request timeout + the stale threshold + one sweep after the restart, every
intent has converged without anyone's help: each provider charge has exactly
one succeeded payment, no payment is left pending, no claim is unresolved.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import State
from idemflow_demo import Settings
from idemflow_demo.app import DemoService, create_app
from idemflow_demo.db import PostgresDatabase
from idemflow_demo.payments import PAYMENT_CREATED
from idemflow_demo.provider import Charge, ChargeRequest, ProviderUnavailable
from tests.demo_stores import mysql_database, redis_prefix
from tests.factories import started
from tests.http.conftest import ALICE, Demo, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KEYS = 60
REQUEST_TIMEOUT = 1.0
SWEEP_EVERY = 0.5
#: The demo's stale threshold for REQUEST_TIMEOUT: 2 × timeout + 10 s.
STALE_AFTER = 2 * REQUEST_TIMEOUT + 10
#: A restart, and a loaded 2-core machine, on top of timeout + threshold + one sweep.
SLACK = 6.0
CONVERGE_WITHIN = REQUEST_TIMEOUT + STALE_AFTER + SWEEP_EVERY + SLACK
#: Half the provider's calls fail (half of those after charging).
FAULTY = (
    *("--provider-failure-rate", "0.5", "--provider-latency-ms", "20"),
    *("--request-timeout", f"{REQUEST_TIMEOUT:g}", "--sweep-every", f"{SWEEP_EVERY:g}"),
)
#: How long a sequential retrier keeps going before the test fails.
RETRY_FOR = 45.0
BACKOFF = 0.1


@dataclass
class Client:
    """One key, retried one request at a time as a well-behaved client does."""

    key: str
    customer: str
    #: Give up at the first answer that is not 201 (or a dropped connection).
    abandons: bool = False
    statuses: list[int] = field(default_factory=list)
    #: The problem type and detail of every 503: the provider's, or the store's (a pool timeout).
    outages: list[tuple[str, str]] = field(default_factory=list)
    errors: int = 0
    final: httpx.Response | None = None

    @property
    def body(self) -> dict[str, Any]:
        return {"amount": 1234, "currency": "EUR", "customer": self.customer}

    @property
    def headers(self) -> dict[str, str]:
        return {**ALICE, "Idempotency-Key": self.key}


def clients(count: int, tag: str, *, abandoning: int = 0) -> list[Client]:
    run = uuid.uuid4().hex[:8]
    return [
        Client(f"{tag}-{run}-{n:03d}", f"{tag}-{run}-{n:03d}", abandons=n < abandoning)
        for n in range(count)
    ]


async def retry_sequentially(http: httpx.AsyncClient, client: Client, deadline: float) -> None:
    """POST until 201, sleeping Retry-After after a 409/503, backing off after a dropped call."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            response = await http.post("/payments", json=client.body, headers=client.headers)
        except httpx.TransportError:
            client.errors += 1
            if client.abandons:
                return
            await asyncio.sleep(BACKOFF)
            continue
        client.statuses.append(response.status_code)
        if response.status_code == 503:
            problem = response.json()
            client.outages.append((problem["type"].rsplit("/", 1)[-1], problem["detail"]))
        if response.status_code == 201:
            client.final = response
            return
        if client.abandons:
            return
        assert response.status_code in (409, 503), response.text
        await asyncio.sleep(float(response.headers.get("retry-after", "1")))


def new_http(url: str) -> httpx.AsyncClient:
    # Idle connections expire before uvicorn's 5 s keep-alive closes them: a
    # request sent on a connection the server is closing dies as a ReadError
    # (seen in the replay burst, after clients that finished early sat idle).
    limits = httpx.Limits(
        max_connections=KEYS + 10, max_keepalive_connections=KEYS + 10, keepalive_expiry=2.0
    )
    return httpx.AsyncClient(base_url=url, timeout=30, limits=limits, verify=False)


@contextlib.contextmanager
def faulty_demo(
    tmp_path: Path, database_url: str | None, pool_size: int, *extra: str
) -> Iterator[Demo]:
    with run_demo(
        tmp_path / "data",
        *FAULTY,
        *("--pool-size", str(pool_size), *extra),
        database_url=database_url,
    ) as demo:
        yield demo


def payments_of(demo: Demo, customers: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    rows = demo.query("SELECT customer, id, status, charge_id FROM payments")
    by_customer: dict[str, list[tuple[Any, ...]]] = {c: [] for c in customers}
    for customer, *rest in rows:
        if customer in by_customer:
            by_customer[customer].append(tuple(rest))
    return by_customer


def charges_of(demo: Demo, customers: list[str]) -> dict[str, list[dict[str, Any]]]:
    by_customer: dict[str, list[dict[str, Any]]] = {c: [] for c in customers}
    with demo.client() as client:
        ledger = client.get("/provider/charges", params={"limit": 10_000}).json()["charges"]
    for charge in ledger:
        if charge["customer"] in by_customer:
            by_customer[charge["customer"]].append(charge)
    return by_customer


def assert_one_payment_and_one_charge_each(demo: Demo, everyone: list[Client]) -> None:
    customers = [c.customer for c in everyone]
    payments, charges = payments_of(demo, customers), charges_of(demo, customers)
    for client in everyone:
        assert client.final is not None, (client.key, client.statuses, client.errors)
        answer = client.final.json()
        assert payments[client.customer] == [(answer["id"], "succeeded", answer["charge_id"])]
        assert [c["id"] for c in charges[client.customer]] == [answer["charge_id"]]


def server_log(demo: Demo) -> str:
    return demo.log.read_text(errors="replace")


# --- a small pool, half the provider calls failing -------------------------------------------


POOLS = [
    pytest.param("postgresql", 1, marks=pytest.mark.postgres, id="postgresql-pool-1"),
    pytest.param("postgresql", 2, marks=pytest.mark.postgres, id="postgresql-pool-2"),
    pytest.param("sqlite", 1, id="sqlite-pool-1"),
    pytest.param("mariadb", 1, marks=pytest.mark.mysql, id="mariadb-pool-1"),
    pytest.param("mariadb", 2, marks=pytest.mark.mysql, id="mariadb-pool-2"),
    pytest.param("redis", 1, marks=pytest.mark.redis, id="redis-pool-1"),
]


@contextlib.contextmanager
def database_for(backend: str, request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The demo's ``--database`` for ``backend``: one of the test's own (None: SQLite)."""
    if backend == "postgresql":
        yield request.getfixturevalue("pg_url")
    elif backend == "mariadb":
        with mysql_database() as url:
            yield url
    elif backend == "redis":
        with redis_prefix() as url:
            yield url
    else:
        yield None


@pytest.mark.anyio
@pytest.mark.parametrize(("backend", "pool_size"), POOLS)
async def test_every_key_reaches_201_with_a_tiny_shared_pool_and_a_failing_provider(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str, pool_size: int
) -> None:
    """60 keys at once, each retried sequentially: all 201, one payment + one charge, no 409.

    The sweeper is off. A released intent whose retries all meet a pool timeout (a
    loaded machine) for longer than the stale threshold looks abandoned to it, and
    its next retry rightly gets the 409 "being recovered" (seen at load 18–29; made
    at will with a 600 ms provider call holding the one connection). With it off, a
    409 can only be a claim some request left behind, whatever the load.
    """
    everyone = clients(KEYS, f"pool{pool_size}")
    unswept = ("--provider-seed", "9", "--sweep-every", "off")
    with (
        database_for(backend, request) as database_url,
        faulty_demo(tmp_path, database_url, pool_size, *unswept) as demo,
    ):
        deadline = asyncio.get_running_loop().time() + RETRY_FOR
        async with new_http(demo.url) as http:
            await asyncio.gather(*(retry_sequentially(http, c, deadline) for c in everyone))
            # And every key once more at once: replays, each authorized by a read.
            replays = await asyncio.gather(
                *(http.post("/payments", json=c.body, headers=c.headers) for c in everyone)
            )
        statuses = [s for c in everyone for s in c.statuses]
        assert 503 in statuses  # the provider did fail: the keys were released and retried
        assert 409 not in statuses, "a sequential retrier met its own unreleased claim"
        # The only other 503: a claim the pool did not serve in time (a loaded machine),
        # refused by the key store before anything was recorded (no 409 came after it).
        # Never the endpoint's own database (a second checkout of its own).
        for slug, detail in (o for c in everyone for o in c.outages):
            assert slug == "provider-unavailable" or "key store unavailable" in detail, detail
        for client, replay in zip(everyone, replays, strict=True):
            assert replay.status_code == 201, replay.text
            assert replay.headers["idempotent-replayed"] == "true"
            assert client.final is not None
            assert replay.content == client.final.content
        assert_one_payment_and_one_charge_each(demo, everyone)
        states = Counter(demo.key_states("alice", [c.key for c in everyone]))
        assert states == {("completed", 201): KEYS}
        log = server_log(demo)
    assert "could not release claim" not in log
    assert "Traceback" not in log


# --- one connection per request, counted in process -----------------------------------------

#: Which request the current task serves, for the pool's checkouts.
SERVING: contextvars.ContextVar[str] = contextvars.ContextVar("serving", default="test")


@dataclass
class Checkouts:
    """Every checkout of a pool, by the request (:data:`SERVING`) that made it."""

    taken: Counter[str] = field(default_factory=Counter)
    held: Counter[str] = field(default_factory=Counter)
    #: The most connections each request held at once.
    most: Counter[str] = field(default_factory=Counter)
    #: Set as each request asks the pool (before it waits).
    asked: defaultdict[str, asyncio.Event] = field(
        default_factory=lambda: defaultdict(asyncio.Event)
    )

    @classmethod
    def of(cls, pool: Any) -> Checkouts:
        """Count ``pool``'s checkouts from now on (``pool.connection()`` calls both methods)."""
        counts, getconn, putconn = cls(), pool.getconn, pool.putconn

        async def counted_getconn(timeout: float | None = None) -> Any:
            who = SERVING.get()
            counts.taken[who] += 1
            counts.asked[who].set()
            connection = await getconn(timeout)
            counts.held[who] += 1
            counts.most[who] = max(counts.most[who], counts.held[who])
            return connection

        async def counted_putconn(connection: Any) -> None:
            counts.held[SERVING.get()] -= 1
            await putconn(connection)

        pool.getconn, pool.putconn = counted_getconn, counted_putconn
        return counts


class GatedProvider:
    """The demo's provider, but the first charge for ``customer`` waits for ``fail``, then fails."""

    def __init__(self, provider: Any, customer: str) -> None:
        self._provider = provider
        self._customer: str | None = customer
        self.entered = asyncio.Event()
        self.fail = asyncio.Event()

    async def charge(self, request: ChargeRequest) -> Charge:
        if request.customer != self._customer:
            charge: Charge = await self._provider.charge(request)
            return charge
        self._customer = None  # its retry is charged
        self.entered.set()
        await self.fail.wait()
        raise ProviderUnavailable("payment provider unreachable (gated)")


@pytest.fixture
async def pool_of_one(
    tmp_path: Path, pg_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[DemoService]:
    """The demo in process on PostgreSQL: one pooled connection for the store and the app.

    Its claims commit as ``request.param`` says (``--claim-commit``; ``own`` by default).
    """
    settings = Settings(
        database_url=pg_url,
        data_dir=tmp_path,
        pool_size=1,
        sweeper=False,
        claim_commit=getattr(request, "param", "own"),
    )
    async with started(DemoService(settings)) as service:
        yield service


async def pay(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """POST /payments under ``key``, its pool checkouts counted under ``key``."""
    SERVING.set(key)  # this task's own context: asyncio.create_task copied it
    body = {"amount": 1234, "currency": "EUR", "customer": key}
    return await http.post("/payments", json=body, headers={**ALICE, "Idempotency-Key": key})


def shared_pool(service: DemoService) -> Any:
    """The one pool the demo's key store and endpoints share (PostgreSQL)."""
    assert isinstance(service.db, PostgresDatabase)
    return service.db.pool


def in_process(service: DemoService) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(create_app(service))
    return httpx.AsyncClient(transport=transport, base_url="http://demo")


@pytest.mark.postgres
@pytest.mark.anyio
@pytest.mark.parametrize("pool_of_one", ["own", "single"], indirect=True)
async def test_a_failed_charge_is_released_on_its_own_connection_while_another_waits(
    pool_of_one: DemoService,
) -> None:
    """The release after a transient failure runs on the request's one connection, in
    both commit modes (single-commit: commit_phase committed the claim, so it takes a
    write too).

    Request "a" holds the pool's only connection in its provider call while "b"
    waits for it. A release that took a connection of its own would queue behind
    "b", which waits for "a": both time out, "b" answers 503 store-unavailable
    and "a"'s key stays claimed (the next retry's 409).
    """
    service = pool_of_one
    key, other = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    provider = GatedProvider(service.payments.provider, key)
    service.payments.provider = provider  # type: ignore[assignment]
    pool = shared_pool(service)
    counts = Checkouts.of(pool)
    async with in_process(service) as http:
        first = asyncio.create_task(pay(http, key))
        await provider.entered.wait()  # "a" holds the one connection, past its first phase
        second = asyncio.create_task(pay(http, other))
        await counts.asked[other].wait()
        assert pool.get_stats()["requests_waiting"] == 1  # "b" waits for it
        provider.fail.set()
        failed, served = await first, await second
        record = await service.db.store.get("alice", key)
        retried = await asyncio.create_task(pay(http, key))

    assert failed.status_code == 503, failed.text
    assert failed.json()["type"].endswith("/provider-unavailable")
    assert record is not None
    assert (record.state, record.recovery_point) == (State.RELEASED, PAYMENT_CREATED)
    assert served.status_code == 201, served.text
    assert retried.status_code == 201, retried.text
    # One checkout per request ("a" twice: its 503 and its retry), never two at once.
    assert (counts.taken[key], counts.most[key], counts.taken[other]) == (2, 1, 1)


@pytest.mark.postgres
@pytest.mark.anyio
@pytest.mark.parametrize("pool_of_one", ["own", "single"], indirect=True)
async def test_a_claim_the_pool_cannot_serve_records_nothing(pool_of_one: DemoService) -> None:
    """A claim whose checkout times out is a 503 before anything is claimed; the retry runs.

    In both commit modes the key store says so ("key store unavailable"), not the demo's
    handler of last resort: with two commits the store takes the checkout (lent to the
    claim), with one the claim's transaction begins inside the store's claim.
    """
    service, key = pool_of_one, f"k-{uuid.uuid4().hex[:8]}"
    pool = shared_pool(service)
    counts = Checkouts.of(pool)
    async with in_process(service) as http:
        async with pool.connection():  # someone else holds the one connection throughout
            timeout, pool.timeout = pool.timeout, 0.05
            refused = await asyncio.create_task(pay(http, key))
            pool.timeout = timeout
        record = await service.db.store.get("alice", key)
        retried = await asyncio.create_task(pay(http, key))

    assert refused.status_code == 503, refused.text
    assert refused.json()["type"].endswith("/store-unavailable")
    assert "key store unavailable" in refused.json()["detail"]
    assert record is None
    assert retried.status_code == 201, retried.text
    assert (counts.taken[key], counts.most[key]) == (2, 1)


# --- stopped mid-load: SIGTERM and SIGKILL ----------------------------------------------------


@dataclass(frozen=True)
class Unsettled:
    """What is left unresolved in the demo's database (all zero once every intent converged)."""

    pending_payments: int
    in_flight_claims: int
    released_with_progress: int

    @classmethod
    def read(cls, demo: Demo, only: list[Client]) -> Unsettled:
        """Count over the intents of ``only`` (the test's database holds no others)."""
        marks = ", ".join("?" * len(only))
        (pending,) = demo.query(
            f"SELECT count(*) FROM payments WHERE status = 'pending' AND customer IN ({marks})",
            *(c.customer for c in only),
        )[0]
        records = [r for r in demo.key_records("alice", [c.key for c in only]) if r is not None]
        in_flight = sum(r.state in (State.IN_PROGRESS, State.STALE) for r in records)
        released = sum(r.state is State.RELEASED and r.recovery_point is not None for r in records)
        return cls(int(pending), in_flight, released)

    @property
    def converged(self) -> bool:
        return self == Unsettled(0, 0, 0)

    def settled(self, *, shared_transaction: bool) -> bool:
        """Has every intent reached its end without a retry? With keys and rows in one
        database: nothing left at all. Without (keys in Redis): no claim left; an intent
        abandoned after phase 1 and never charged ends released with its pending row
        kept, for a retry to resume from (``idemflow_demo.recovery``)."""
        return self.converged if shared_transaction else self.in_flight_claims == 0


def wait_until_converged(
    demo: Demo, within: float, only: list[Client], *, shared_transaction: bool = True
) -> float:
    """Poll the database until every one of ``only``'s intents settled; the seconds taken."""
    started = time.monotonic()
    while not (left := Unsettled.read(demo, only)).settled(shared_transaction=shared_transaction):
        assert time.monotonic() - started < within, f"not converged after {within:g} s: {left}"
        time.sleep(0.2)
    return time.monotonic() - started


def assert_every_charge_has_one_succeeded_payment(
    demo: Demo, everyone: list[Client], *, shared_transaction: bool = True
) -> None:
    """A charge: one succeeded payment naming it. No charge: no payment (without a shared
    transaction, at most the pending row a retry would resume from)."""
    customers = [c.customer for c in everyone]
    payments, charges = payments_of(demo, customers), charges_of(demo, customers)
    for client in everyone:
        rows, charged = payments[client.customer], charges[client.customer]
        assert len(charged) <= 1, charged
        if charged:
            assert rows == [(rows[0][0], "succeeded", charged[0]["id"])], (client.key, rows)
        elif shared_transaction or not rows:
            assert rows == [], (client.key, rows)
        else:
            assert rows == [(rows[0][0], "pending", None)], (client.key, rows)


async def answered(everyone: list[Client], count: int) -> None:
    while sum(c.final is not None for c in everyone) < count:
        await asyncio.sleep(0.05)


STOPS = [
    pytest.param("postgresql", signal.SIGTERM, marks=pytest.mark.postgres, id="SIGTERM"),
    pytest.param("postgresql", signal.SIGKILL, marks=pytest.mark.postgres, id="SIGKILL"),
    pytest.param("mariadb", signal.SIGTERM, marks=pytest.mark.mysql, id="mariadb-SIGTERM"),
    pytest.param("mariadb", signal.SIGKILL, marks=pytest.mark.mysql, id="mariadb-SIGKILL"),
    pytest.param("redis", signal.SIGKILL, marks=pytest.mark.redis, id="redis-SIGKILL"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("backend", "stop"), STOPS)
async def test_a_demo_stopped_mid_load_converges_after_restart(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str, stop: signal.Signals
) -> None:
    """Retried or abandoned, every intent settles within timeout + threshold + one sweep."""
    everyone = clients(50, stop.name.lower(), abandoning=25)
    loop = asyncio.get_running_loop()
    slow = ("--provider-latency-ms", "300")  # requests are in flight when the signal lands
    shared = backend != "redis"  # keys and payments in one database
    with (
        database_for(backend, request) as url,
        faulty_demo(tmp_path, url, 2, *slow) as doomed,
    ):
        port = doomed.url.rsplit(":", 1)[1]
        async with new_http(doomed.url) as http:
            deadline = loop.time() + RETRY_FOR
            load = asyncio.gather(*(retry_sequentially(http, c, deadline) for c in everyone))
            await asyncio.wait_for(answered(everyone, 10), RETRY_FOR)
            doomed.process.send_signal(stop)
            assert await asyncio.to_thread(doomed.process.wait, 30) == -stop
            if stop is signal.SIGTERM:
                # Graceful: what was in flight finished or was released; nothing orphaned.
                assert Unsettled.read(doomed, everyone).in_flight_claims == 0
            with faulty_demo(tmp_path, url, 2, *slow, "--port", port) as demo:
                # The abandoned intents converge without anyone's help, within the bound
                # counted from the restart (the sweeper and the reconciler alone) ...
                abandoned = [c for c in everyone if c.abandons]
                await asyncio.to_thread(
                    wait_until_converged,
                    demo,
                    CONVERGE_WITHIN,
                    abandoned,
                    shared_transaction=shared,
                )
                # ... while the persistent half gets its 201s across the restart, as soon
                # as the sweeper frees their orphaned claims and the provider lets them.
                await load
                await asyncio.to_thread(
                    wait_until_converged, demo, CONVERGE_WITHIN, everyone, shared_transaction=shared
                )
                assert_every_charge_has_one_succeeded_payment(
                    demo, everyone, shared_transaction=shared
                )
                assert all(c.final is not None for c in everyone if not c.abandons)
                # Now the abandoned keys come back once: a charged intent replays its
                # payment, one that was not charged runs afresh; one of each per key.
                for client in everyone:
                    client.abandons = False
                await asyncio.gather(
                    *(retry_sequentially(http, c, loop.time() + RETRY_FOR) for c in everyone)
                )
                assert_one_payment_and_one_charge_each(demo, everyone)
                assert Unsettled.read(demo, everyone).converged
                log = server_log(demo)
    assert "could not release claim" not in log


# --- /healthz while every pooled connection is held ------------------------------------------

#: The provider call a request makes while it holds the demo's one pooled connection.
SLOW_CHARGE_MS = 6000
#: Far less than that call: a probe that queued for the pool would time out.
PROBE_TIMEOUT = 3.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("postgresql", marks=pytest.mark.postgres),
        "sqlite",
        pytest.param("mariadb", marks=pytest.mark.mysql),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
async def test_healthz_answers_while_a_request_holds_every_pooled_connection(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    """A pool of one, held by a request through a 6 s provider call: /healthz answers 200 now.

    It once queued for the pool like any request, so it answered only once the charge
    was done; after a restart the storm's herd of retries held the pool that way, and
    the storm, probing with a 2 s timeout, took a demo that was up for one that never
    started (a red CI run on PostgreSQL).
    """
    slow = ("--pool-size", "1", "--provider-latency-ms", str(SLOW_CHARGE_MS))
    (client,) = clients(1, "held")
    with (
        database_for(backend, request) as database_url,
        run_demo(tmp_path / "data", *slow, database_url=database_url) as demo,
    ):
        async with new_http(demo.url) as http:
            charge = asyncio.create_task(
                http.post("/payments", json=client.body, headers=client.headers)
            )
            await until_claimed(http, charge)  # the request holds the connection from here
            health = await http.get("/healthz", timeout=PROBE_TIMEOUT)
            assert health.status_code == 200, health.text
            assert health.json() == {"status": "ok"}
            assert not charge.done()  # answered while the request still held the pool
            assert (await charge).status_code == 201


async def until_claimed(http: httpx.AsyncClient, charge: asyncio.Task[httpx.Response]) -> None:
    """Return once /metrics counts the request's claim (it is past its checkout)."""
    deadline = asyncio.get_running_loop().time() + 30
    while asyncio.get_running_loop().time() < deadline and not charge.done():
        metrics = (await http.get("/metrics")).text
        if any(
            line.startswith("idemflow_requests_total{")
            and 'outcome="claimed"' in line
            and not line.endswith(" 0.0")
            for line in metrics.splitlines()
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the request was not claimed in time (done: {charge.done()})")
