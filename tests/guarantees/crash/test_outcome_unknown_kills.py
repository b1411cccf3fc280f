"""
SIGKILL around ``OutcomeUnknown``: the server dies right after the handler raised it
(while idemflow acts on it) or while its 503 ``outcome-unknown`` answer is being written,
in transactional mode (Starlette's ``Idempotent``, two commits) and in middleware mode,
on PostgreSQL (``tests/guarantees/crash/outcome_unknown_app.py``; the server kills itself, as the
demo's crash points do).

The provider charged before the raise, so nothing may run the charge again: after the
kill the key is still claimed (``in_progress``), the retry to the restarted server gets
409 with ``Retry-After``, and the sweeper's reconciler, reading the provider's ledger,
settles the key (in transactional mode writing the payment row the rolled-back request
never committed, in the sweeper's transaction): the retry then replays it, and the
ledger holds exactly one charge.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import Policy, Response, State
from tests.servers import serve_on_socket

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]
POLICY = Policy(request_timeout=1)  # as the app's


@contextlib.contextmanager
def server(url: str, mode: str, log: Path, crash_at: str | None = None) -> Iterator[Any]:
    """uvicorn serving the app on a loopback socket bound here; yields (base URL, process)."""
    env = {k: "" for k in os.environ if k.startswith("OU_")}
    env.update({"OU_DATABASE_URL": url, "OU_MODE": mode, "OU_CRASH_AT": crash_at or ""})

    def command(fd: int) -> list[str]:
        return [
            sys.executable, "-m", "uvicorn", "tests.guarantees.crash.outcome_unknown_app:app",
            "--fd", str(fd), "--lifespan", "on", "--log-level", "warning",
        ]  # fmt: skip

    with serve_on_socket(command, log, env=env, cwd=ROOT, backlog=16) as served:
        yield served


def query(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description is not None else []


def pay(base: str, key: str) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    return httpx.post(
        base + "/payments", content=b'{"amount": 1000}', headers=headers, timeout=30, verify=False
    )


@pytest.mark.parametrize("crash_at", ["raised", "answer"])
@pytest.mark.parametrize("mode", ["transactional", "middleware"])
def test_a_sigkill_around_outcome_unknown_keeps_the_claim_and_charges_once(
    mode: str, crash_at: str, pg_url: str, tmp_path: Path
) -> None:
    from idemflow.edge import pooled_transaction
    from idemflow.stores.postgres import PostgresStore
    from idemflow.sweeper import DidNotHappen, Happened, Sweeper
    from idemflow.transactions import PsycopgTransaction

    query(pg_url, "CREATE TABLE payments (key TEXT PRIMARY KEY, state TEXT NOT NULL)")
    query(pg_url, "CREATE TABLE ledger (key TEXT NOT NULL)")
    store = PostgresStore(pg_url, max_size=2, clock="caller")
    store.migrate()
    key, log = f"ou-{uuid.uuid4().hex}", tmp_path / "server.log"
    try:
        with server(pg_url, mode, log, crash_at) as (base, process):
            answered: list[Any] = []

            def first() -> None:
                try:
                    answered.append(pay(base, key))
                except httpx.TransportError as exc:  # the kill is the only answer
                    answered.append(exc)

            sender = threading.Thread(target=first)
            sender.start()
            assert process.wait(20) == -signal.SIGKILL  # it died at its crash point
            sender.join(20)
        assert len(answered) == 1
        assert not isinstance(answered[0], httpx.Response) or answered[0].status_code != 201

        record = store.get("alice", key)
        assert record is not None
        assert record.state is State.IN_PROGRESS  # still claimed: nobody may charge again yet
        assert query(pg_url, "SELECT count(*) FROM ledger WHERE key = %s", key) == [(1,)]
        assert query(pg_url, "SELECT count(*) FROM payments") == [(0,)]  # rolled back, or none

        with server(pg_url, mode, log) as (base, _):
            busy = pay(base, key)
            assert busy.status_code == 409, busy.text  # not a second charge
            assert int(busy.headers["retry-after"]) >= 1

            def reconciler(record: Any, keys: Any) -> Any:
                """The provider's ledger says whether the charge went through."""
                charged = query(pg_url, "SELECT count(*) FROM ledger WHERE key = %s", record.key)
                if charged == [(0,)]:
                    return DidNotHappen("no charge in the ledger")

                def succeeded(conn: Any) -> None:  # the row the killed request never committed
                    conn.execute(
                        "INSERT INTO payments (key, state) VALUES (%s, 'succeeded')", (record.key,)
                    )

                response = Response.json(201, {"key": record.key, "state": "succeeded"})
                return Happened(response, apply=succeeded if mode == "transactional" else None)

            # Past the stale threshold, on the store's (caller's) clock: no waiting for it.
            later = time.time() + POLICY.stale_seconds + 1
            sweeper = Sweeper(
                store,
                POLICY,
                reconciler=reconciler,
                transaction_factory=lambda: pooled_transaction(
                    store.pool.connection, PsycopgTransaction
                ),
                clock=lambda: later,
            )
            report = sweeper.sweep_once()
            replay = pay(base, key)
            again = pay(base, key)
    finally:
        store.close()

    assert report.completed == 1, report
    assert replay.status_code == 201, replay.text
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == {"key": key, "state": "succeeded"}
    assert again.content == replay.content
    assert query(pg_url, "SELECT count(*) FROM ledger WHERE key = %s", key) == [(1,)]  # once
    expected = [(key, "succeeded")] if mode == "transactional" else []
    assert query(pg_url, "SELECT key, state FROM payments") == expected
