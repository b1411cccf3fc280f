"""
The Celery adapter against real ``celery worker`` processes (two per broker, ``--pool=solo``,
kept for the module) on the Redis and the RabbitMQ broker, tasks on PostgreSQL and SQLite
stores, each business row written in the app's transaction: a task sent twice and run by
two workers at once has one effect (the duplicate retried, never waiting, then given the
stored result); a poisoned task (same key, other arguments) is rejected without an effect
(dead-lettered on RabbitMQ); a transient failure is retried and run once; a worker
SIGKILLed after its business write and commit, before its ack, has its task redelivered
to the other worker and acked with the stored result; one SIGKILLed before its commit
has its task retried past ``max_retries`` until the sweeper releases the claim, then run
once; so has a prefork pool child's (requeued, not acked as failed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    Attempt,
    ConfigurationError,
    Idempotency,
    Intent,
    Response,
    State,
)
from idemflow.stores.memory import MemoryStore
from tests.backends import REDIS_URL, delete_keys, redis_client
from tests.conftest import POSTGRES_URL, unreachable
from tests.consumers._support import ROOT
from tests.factories import POLICY
from tests.sweeping import sweep_away

celery = pytest.importorskip("celery")
psycopg = pytest.importorskip("psycopg")
from celery.exceptions import Reject  # noqa: E402

from idemflow.consumers.celery import exactly_once  # noqa: E402
from tests.consumers._celery_app import make_app  # noqa: E402

RABBITMQ_URL = os.environ.get("IDEMFLOW_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
# On either broker the results and the tests' signals are on Redis, the stores' tables
# on PostgreSQL.
BROKERS = [
    pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.postgres]),
    pytest.param("rabbitmq", marks=[pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.postgres]),
]
STORES = ["postgres", "sqlite"]
#: The longest a test waits for a worker (a retry comes after 1 s, a lost Redis message after 3 s).
PATIENCE = 30.0


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    """``condition()``'s first truthy answer, polled; fails after ``PATIENCE`` seconds."""
    deadline = time.monotonic() + PATIENCE
    while not (answer := condition()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)
    return answer


@dataclass
class Workers:
    """Two workers of the app on one broker, the stores they use, the Redis the test
    signals them through."""

    broker: str
    app: Any
    prefix: str
    env: dict[str, str]
    logs: Path
    stores: dict[str, Any]
    redis: Any
    running: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def start(self, name: str, *options: str) -> tuple[subprocess.Popen[bytes], Path]:
        """Worker ``name`` (``--pool=solo`` unless ``options`` say otherwise), its log
        beside the SQLite file."""
        log = self.logs / f"worker-{name}-{time.monotonic_ns()}.log"
        command = [sys.executable, "-m", "celery", "-A", "tests.consumers._celery_app"]
        command += ["worker", "--pool=solo", "--without-heartbeat", "--without-gossip"]
        command += ["--without-mingle", "-l", "info", "-n", f"{name}-{self.prefix}@%h", *options]
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=out, env=self.env, cwd=ROOT)
        return process, log

    def ready(self) -> None:
        """Both workers running (a killed one replaced) and consuming."""
        if not self.running:
            self.running = [self.start("w0"), self.start("w1")]
        for slot, (process, _) in enumerate(self.running):
            if process.poll() is not None:
                self.running[slot] = self.start(f"w{slot}")
        for process, log in self.running:
            consuming(process, log)

    def send(self, store: str, key: str, order: str, mode: str = "plain", **options: Any) -> Any:
        return self.app.send_task(
            f"shop.charge.{store}",
            (order,),
            {"mode": mode},
            headers={"idempotency_key": key},
            **options,
        )

    def rows(self, store: str, key: str) -> int:
        """Committed business rows for ``key``."""
        table = self.prefix.replace("-", "_")
        sql = f"SELECT count(*) FROM biz_{table} WHERE key = %s"
        if store == "postgres":
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                row = conn.execute(sql, (key,)).fetchone()
        else:
            with contextlib.closing(sqlite3.connect(self.env["IDEMFLOW_CELERY_SQLITE"])) as conn:
                row = conn.execute(sql.replace("%s", "?"), (key,)).fetchone()
        assert row is not None
        return int(row[0])

    def record(self, store: str, key: str) -> Any:
        return self.stores[store].get(f"shop.charge.{store}", key)

    def killable(self) -> int:
        """The PID of the worker that stalled where it is to be SIGKILLed."""
        found = wait_for(lambda: self.redis.getdel(f"{self.prefix}:killable"), "a stall")
        return int(found)


def consuming(process: subprocess.Popen[bytes], log: Path) -> None:
    """Returns once the worker says it is ready; fails with its log if it died."""
    wait_for(lambda: b" ready." in log.read_bytes() or process.poll() is not None, "ready")
    assert process.poll() is None, log.read_text()


def reachable(kind: str, app: Any, url: str) -> None:
    try:
        with app.connection_for_write(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # whatever the transport raises
        unreachable(kind, exc)


@contextlib.contextmanager
def tables(prefix: str, sqlite: Path) -> Iterator[dict[str, Any]]:
    """The stores' and business tables on PostgreSQL and SQLite (dropped after)."""
    from idemflow.stores.postgres import PostgresStore
    from idemflow.stores.sqlite import SQLiteStore

    table = prefix.replace("-", "_")
    create = f"CREATE TABLE biz_{table} (id INTEGER PRIMARY KEY, key TEXT, note TEXT)"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(create.replace("INTEGER PRIMARY KEY", "BIGSERIAL PRIMARY KEY"))
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    with contextlib.closing(sqlite3.connect(sqlite)) as lite:
        lite.execute(create)
    stores = {
        "postgres": PostgresStore(POSTGRES_URL, table=table, clock="caller"),  # the test sweeps
        "sqlite": SQLiteStore(sqlite, table=table),
    }
    for store in stores.values():
        store.migrate()
    try:
        yield stores
    finally:
        for store in stores.values():
            store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE biz_{table}")
            conn.execute(f"DROP TABLE {table}")


@pytest.fixture(scope="module", params=BROKERS)
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Workers]:
    """Two workers on the broker, for the module (each test's keys its own)."""
    broker = REDIS_URL if request.param == "redis" else RABBITMQ_URL
    prefix = f"idemflow-test-celery-{uuid.uuid4().hex[:10]}"
    app = make_app(prefix, broker)
    reachable("Redis", app, REDIS_URL)
    if request.param == "rabbitmq":
        reachable("RabbitMQ", app, broker)
    logs = tmp_path_factory.mktemp("celery")
    sqlite = logs / "shop.db"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
        "IDEMFLOW_CELERY_PREFIX": prefix,
        "IDEMFLOW_CELERY_BROKER": broker,
        "IDEMFLOW_CELERY_SQLITE": str(sqlite),
        "IDEMFLOW_CELERY_PG": POSTGRES_URL,
    }
    client = redis_client()
    with tables(prefix, sqlite) as stores, app.connection_for_write() as conn:
        if request.param == "rabbitmq":  # where the task queue dead-letters to
            conn.default_channel.queue_declare(f"{prefix}.dead", durable=True, auto_delete=False)
        shop = Workers(request.param, app, prefix, env, logs, stores, client)
        try:
            shop.ready()
            yield shop
        finally:
            for process, _ in shop.running:  # nothing of theirs outlives the keys and queues
                process.kill()
                process.wait()
            if request.param == "rabbitmq":
                for queue in (prefix, f"{prefix}.dead", f"{prefix}.prefork"):
                    conn.default_channel.queue_delete(queue)
                for exchange in (prefix, f"{prefix}.prefork"):
                    conn.default_channel.exchange_delete(exchange)
            delete_keys(client, prefix)
            client.close()
            app.close()


@pytest.fixture
def shop(workers: Workers) -> Workers:
    """The module's workers, both running (this module's ``shop``, not the conftest's)."""
    workers.ready()
    return workers


def key() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("store", STORES)
def test_a_task_sent_twice_and_run_by_two_workers_at_once_has_one_effect(
    shop: Workers, store: str
) -> None:
    order = key()
    first = shop.send(store, order, "o-1", "hold")
    wait_for(lambda: shop.redis.exists(f"{shop.prefix}:running:{order}"), "the first run")
    second = shop.send(store, order, "o-1", "hold")  # to the other worker: this one is busy
    # The duplicate met the claim and was retried (with a countdown), never waiting.
    wait_for(lambda: second.state == "RETRY", "the duplicate retried")
    shop.redis.set(f"{shop.prefix}:go:{order}", 1)

    assert first.get(timeout=PATIENCE) == {"charged": "o-1"}
    assert second.get(timeout=PATIENCE) == {"charged": "o-1"}  # the stored result
    assert shop.rows(store, order) == 1


@pytest.mark.parametrize("store", STORES)
def test_a_poisoned_task_is_rejected_without_an_effect(shop: Workers, store: str) -> None:
    order = key()
    assert shop.send(store, order, "o-1").get(timeout=PATIENCE) == {"charged": "o-1"}
    poisoned = shop.send(store, order, "o-2")  # the same key, other arguments

    rejected = poisoned.get(timeout=PATIENCE, propagate=False)
    assert isinstance(rejected, Reject)
    assert "different request" in str(rejected)
    assert shop.rows(store, order) == 1
    if shop.broker == "rabbitmq":  # the queue's dead-letter exchange has it
        with shop.app.connection_for_write() as conn:
            dead = conn.SimpleQueue(f"{shop.prefix}.dead")
            message = dead.get(timeout=PATIENCE)
            assert message.headers["id"] == poisoned.id
            assert message.payload[0] == ["o-2"]
            message.ack()
            dead.close()


@pytest.mark.parametrize("store", STORES)
def test_a_transient_failure_is_retried_and_run_once(shop: Workers, store: str) -> None:
    order = key()
    result = shop.send(store, order, "o-1", "flaky")

    assert result.get(timeout=PATIENCE) == {"charged": "o-1"}
    assert shop.rows(store, order) == 1  # the first run's row rolled back with its failure
    record = shop.record(store, order)
    assert (record.state, record.attempt) == (State.COMPLETED, 2)


@pytest.mark.parametrize("store", STORES)
def test_a_worker_killed_between_its_commit_and_its_ack_has_one_effect(
    shop: Workers, store: str
) -> None:
    """The SIGKILLed worker's message comes back (RabbitMQ: at once; Redis: past the
    visibility timeout) to the other worker, which acks it with the stored result."""
    order = key()
    result = shop.send(store, order, "o-1", "die")
    pid = shop.killable()
    assert shop.rows(store, order) == 1  # committed, the ack not sent
    os.kill(pid, signal.SIGKILL)

    acked = f"{shop.prefix}:acked:{result.id}"
    assert int(wait_for(lambda: shop.redis.lpop(acked), "the redelivery acked")) != pid
    assert result.get(timeout=PATIENCE) == {"charged": "o-1"}
    assert shop.rows(store, order) == 1
    record = shop.record(store, order)
    assert (record.state, record.attempt) == (State.COMPLETED, 1)  # never run again


def test_a_long_task_keeps_its_lease_and_one_whose_lease_is_stolen_never_completes(
    shop: Workers,
) -> None:
    """Through the broker, on the test's clock (shared in Redis): a task held past its
    threshold keeps its claim by renewing it and charges once let go; a task whose claim
    the sweeper ended and another worker took is retried, its write rolled back, until
    that owner settles the key, then answers the stored result."""
    store, clock = shop.stores["sqlite"], f"{shop.prefix}:clock"
    now = 1_800_000_000.0
    shop.redis.set(clock, now)
    kept, stolen = key(), key()

    def hold(order: str) -> Any:
        sent = shop.app.send_task("shop.hold.sqlite", (order,), headers={"idempotency_key": order})
        wait_for(lambda: shop.redis.exists(f"{shop.prefix}:running:{order}"), "the run")
        return sent

    def renewed(order: str, at: float) -> bool:
        record = store.get("shop.hold.sqlite", order)
        return record is not None and record.stale_at == at + POLICY.stale_seconds

    first = hold(kept)
    shop.redis.set(clock, now := now + POLICY.stale_seconds - 1)
    wait_for(lambda: renewed(kept, now), "a renewal on the moved clock")
    assert sweep_away(store, now + 2) == []  # past the threshold from the claim: kept
    shop.redis.set(f"{shop.prefix}:go:{kept}", 1)
    assert first.get(timeout=PATIENCE) == {"charged": kept}
    assert shop.rows("sqlite", kept) == 1

    second = hold(stolen)
    (swept,) = sweep_away(store, now + 10 * POLICY.stale_seconds)  # its deadline long past
    intent = Intent(swept.principal, swept.key, swept.fingerprint, swept.endpoint)
    assert store.claim(intent, "lease-b", now, now + 3600).owned
    shop.redis.set(f"{shop.prefix}:go:{stolen}", 1)
    wait_for(lambda: second.state == "RETRY", "the task retried, not completed")
    assert shop.rows("sqlite", stolen) == 0  # its write rolled back with the lost completion
    taken = store.get("shop.hold.sqlite", stolen)
    answer = Response.json(200, {"charged": "by lease-b"})
    store.complete(taken, State.COMPLETED, answer, now, now + 3600)
    assert second.get(timeout=PATIENCE) == {"charged": "by lease-b"}  # the stored result


#: On RabbitMQ only: its redelivery comes at once, while the claim is young and its
#: retries' countdowns short (they follow the claim's age). On Redis the redelivery waits
#: for the visibility timeout, and each retry after it for the sweeper's threshold.
@pytest.mark.parametrize("workers", [BROKERS[1]], indirect=True)
def test_a_worker_killed_before_its_commit_has_one_effect_once_the_sweeper_passes(
    shop: Workers,
) -> None:
    """Nothing committed, the claim left behind: the redelivery is retried (more often
    than the task's ``max_retries=1``: waiting is not failing) until the sweeper releases
    the claim, then runs once."""
    order = key()
    result = shop.send("postgres", order, "o-1", "stall")
    os.kill(shop.killable(), signal.SIGKILL)

    retried = f"{shop.prefix}:retried:{result.id}"
    wait_for(lambda: shop.redis.llen(retried) >= 2, "the redelivery retried twice")
    assert shop.rows("postgres", order) == 0  # rolled back with the kill, never run again
    (released,) = sweep_away(shop.stores["postgres"], time.time() + POLICY.stale_seconds + 1)
    assert released.key == order
    assert result.get(timeout=PATIENCE) == {"charged": "o-1"}
    assert shop.rows("postgres", order) == 1
    assert shop.record("postgres", order).attempt == 2


#: On one broker: the pool notices a dead child within seconds (its maintenance timer).
@pytest.mark.parametrize("workers", [BROKERS[0]], indirect=True)
def test_a_pool_child_killed_before_its_commit_has_its_task_requeued_then_run_once(
    shop: Workers,
) -> None:
    """``reject_on_worker_lost``: the message of a prefork child SIGKILLed mid-task is
    requeued, not acked as failed (Celery's default, which would lose the job): once the
    sweeper has released the dead child's claim, the requeued task runs once."""
    queue = f"{shop.prefix}.prefork"
    process, log = shop.start("prefork", "--pool=prefork", "--concurrency=1", "-Q", queue)
    try:
        consuming(process, log)
        order = key()
        result = shop.send("postgres", order, "o-1", "stall", queue=queue)
        os.kill(shop.killable(), signal.SIGKILL)  # the pool's child, not the worker
        (released,) = sweep_away(shop.stores["postgres"], time.time() + POLICY.stale_seconds + 1)
        assert released.key == order

        assert result.get(timeout=PATIENCE) == {"charged": "o-1"}
        assert shop.rows("postgres", order) == 1  # the first run rolled back with the kill
        assert shop.record("postgres", order).attempt == 2
    finally:
        process.terminate()  # a warm shutdown ends the pool's children too
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_task_applied_in_process_maps_each_outcome_and_unsafe_options_are_refused() -> None:
    """Celery's local ``apply()`` (no broker): run once, the stored result replayed, a
    poisoned or keyless task rejected, a non-JSON answer returned as text; a call that
    does not fit the handler refused when sent."""
    app = celery.Celery("local", set_as_current=False)
    effects: list[str] = []

    @exactly_once(app, Idempotency(MemoryStore()))
    def charge(attempt: Attempt, order: str) -> dict[str, str]:
        effects.append(order)
        return {"charged": order}

    @exactly_once(app, Idempotency(MemoryStore()), key=lambda order: f"receipt-{order}")
    def receipt(attempt: Attempt, order: str) -> Response:
        return Response(200, f"receipt {order}".encode(), (("content-type", "text/plain"),))

    sent = [charge.apply(("o-1",), headers={"idempotency_key": "k-1"}) for _ in range(2)]
    poisoned = charge.apply(("o-2",), headers={"idempotency_key": "k-1"})
    keyless = charge.apply(("o-3",))

    assert [result.get() for result in sent] == [{"charged": "o-1"}] * 2
    assert effects == ["o-1"]
    assert isinstance(poisoned.result, Reject)
    assert "different request" in str(poisoned.result)
    assert "no 'idempotency_key' header" in str(keyless.result)
    assert [receipt.apply(("o-1",)).get() for _ in range(2)] == ["receipt o-1"] * 2
    with pytest.raises(TypeError):  # checked against the handler's signature when sent
        charge.apply_async(("o-1", "surplus"), headers={"idempotency_key": "k-2"})
    with pytest.raises(ConfigurationError, match="acks_late=True"):
        exactly_once(app, Idempotency(MemoryStore()), acks_late=False)
