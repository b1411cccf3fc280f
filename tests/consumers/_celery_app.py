"""
The Celery app of ``test_celery.py``: `make_app` (the configuration the test sends with)
and, in a worker (``celery -A tests.consumers._celery_app``, its ``IDEMFLOW_CELERY_*``
environment set), one exactly-once task per store (``shop.charge.postgres``,
``shop.charge.sqlite``) writing its business row in the app's transaction, each retry
pushed to ``<prefix>:retried:<task id>``, and ``shop.hold.sqlite``, renewing its lease on
the test's clock until the test lets it charge.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery
from celery.signals import task_retry

from idemflow import Attempt, Idempotency
from idemflow.stores.protocol import Transaction
from tests.backends import REDIS_URL, redis_client
from tests.factories import POLICY


def make_app(prefix: str, broker: str) -> Celery:
    """The app on ``broker``, every name under ``prefix``: its queue (dead-lettered to
    ``<prefix>.dead`` on RabbitMQ), the broker's and the results' Redis keys."""
    app = Celery("shop", broker=broker, set_as_current=False)
    dead = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{prefix}.dead"}
    app.conf.update(
        task_queues={prefix: {"exchange": prefix, "routing_key": prefix, "queue_arguments": dead}},
        task_default_queue=prefix,
        result_backend=REDIS_URL,
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        result_expires=600,
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=False,
        broker_connection_retry_on_startup=True,
        # Redis: an unacked message (its worker killed) is back after 3 s, looked for each second.
        broker_transport_options={
            "global_keyprefix": f"{prefix}:",
            "visibility_timeout": 3,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    )
    return app


def register(app: Celery, prefix: str, sqlite: str, postgres: str) -> None:
    """The tasks, one per store, the stores' and business tables named after ``prefix``."""
    import psycopg

    from idemflow.consumers.celery import exactly_once
    from idemflow.stores.postgres import PostgresStore
    from idemflow.stores.sqlite import SQLiteStore, connect
    from idemflow.transactions import PsycopgTransaction, SQLite3Transaction

    table, client = prefix.replace("-", "_"), redis_client()

    def charge(attempt: Attempt, order: str, mode: str = "plain") -> dict[str, str]:
        """The business row for ``order``; ``mode`` "hold" first waits until the test says
        go, "flaky" fails its first run (the row rolled back with it), "stall" has its first
        run wait there (its PID at ``<prefix>:killable``) to be SIGKILLed."""
        if mode == "hold":  # before the write: SQLite's one writer would queue the duplicate
            client.set(f"{prefix}:running:{attempt.record.key}", 1)
            deadline = time.monotonic() + 20
            while not client.exists(f"{prefix}:go:{attempt.record.key}"):
                assert time.monotonic() < deadline, "never told to go"
                time.sleep(0.05)
        sql = f"INSERT INTO biz_{table} (key, note) VALUES (%s, %s)"
        if isinstance(attempt.connection, psycopg.Connection):
            attempt.connection.execute(sql, (attempt.record.key, order))
        else:
            attempt.connection.execute(sql.replace("%s", "?"), (attempt.record.key, order))
        if mode == "flaky" and attempt.record.attempt == 1:
            raise ConnectionError("the provider is down")
        if mode == "stall" and attempt.record.attempt == 1:  # SIGKILLed before its commit
            client.set(f"{prefix}:killable", os.getpid())
            threading.Event().wait()
        return {"charged": order}

    @contextlib.contextmanager
    def postgres_transaction() -> Iterator[Transaction]:
        with psycopg.connect(postgres, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    @contextlib.contextmanager
    def sqlite_transaction() -> Iterator[Transaction]:
        with contextlib.closing(connect(sqlite)) as conn:
            yield SQLite3Transaction(conn)

    stores: dict[str, Any] = {
        "postgres": (PostgresStore(postgres, table=table), postgres_transaction),
        "sqlite": (SQLiteStore(sqlite, table=table), sqlite_transaction),
    }
    for kind, (store, transaction) in stores.items():
        # One retry for a failure; the waits for a claim to end are not counted.
        exactly_once(
            app,
            Idempotency(store, POLICY),
            transaction=transaction,
            name=f"shop.charge.{kind}",
            max_retries=1,
        )(charge)

    def shared_clock() -> float:
        """The test's clock, which it moves in Redis (the store's caller clock)."""
        return float(client.get(f"{prefix}:clock") or 0.0)

    def hold(attempt: Attempt, order: str) -> dict[str, str]:
        """Runs until the test says go (its lease renewed meanwhile), then charges."""
        client.set(f"{prefix}:running:{attempt.record.key}", 1)
        deadline = time.monotonic() + 30
        while not client.exists(f"{prefix}:go:{attempt.record.key}"):
            assert time.monotonic() < deadline, "never told to go"
            time.sleep(0.02)
        sql = f"INSERT INTO biz_{table} (key, note) VALUES (?, ?)"
        attempt.connection.execute(sql, (attempt.record.key, order))
        return {"charged": order}

    store, transaction = stores["sqlite"]
    exactly_once(
        app,
        Idempotency(store, POLICY, clock=shared_clock),
        transaction=transaction,
        name="shop.hold.sqlite",
        renew_every=0.02,
    )(hold)

    def retried(request: Any, **kwargs: Any) -> None:  # each retry counted for the test
        client.rpush(f"{prefix}:retried:{request.id}", 1)

    task_retry.connect(retried, weak=False)


def stall_dying_acks(prefix: str) -> None:
    """A task sent with ``mode="die"`` has its first ack stall: the worker's PID is put at
    ``<prefix>:killable`` (its business row and completion committed), to be SIGKILLed;
    the PID of each later ack of it is pushed to ``<prefix>:acked:<task id>``."""
    from celery.worker.request import Request

    client, ack = redis_client(), Request.acknowledge

    def acknowledge(self: Request) -> None:
        dying = self.kwargs.get("mode") == "die"
        if dying and client.set(f"{prefix}:died:{self.id}", 1, nx=True):
            client.set(f"{prefix}:killable", os.getpid())
            threading.Event().wait()
        ack(self)
        if dying:
            client.rpush(f"{prefix}:acked:{self.id}", os.getpid())

    Request.acknowledge = acknowledge


if "IDEMFLOW_CELERY_PREFIX" in os.environ:  # in a worker
    _prefix = os.environ["IDEMFLOW_CELERY_PREFIX"]
    app = make_app(_prefix, os.environ["IDEMFLOW_CELERY_BROKER"])
    register(app, _prefix, os.environ["IDEMFLOW_CELERY_SQLITE"], os.environ["IDEMFLOW_CELERY_PG"])
    stall_dying_acks(_prefix)
