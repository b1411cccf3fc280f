"""
The demo on a database of its own, restarted between two bursts of payments: every
pooled connection died with the server. On PostgreSQL the demo takes the request's
connection through the store's checkout (``store.connection``), which skips a connection
the server closed; on MariaDB the demo's own business pool asks
``idemflow.stores.mysql.closed_by_server`` of each idle connection it hands out, as the
store's pool does. Seen from outside: no request after the restart is refused, each
charges once, and the payments from before the restart replay.

A demo started while its database is down (restarting, or too busy to hand out a
connection) waits for it and comes up with it, rather than exiting at its first
timed-out checkout.

Redis (the keys) restarted under the demo quarantines new claims for the demo's own
stale threshold, by design, while the payments from before replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import unreachable
from tests.http.conftest import ALICE, PAYMENT, Demo, new_key, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: More concurrent requests than the demo's pool holds connections, so every pooled
#: connection has served (and dies with the server).
BURST = 12


async def post_all(demo: Demo, keys: list[str]) -> list[httpx.Response]:
    """A payment for each key, all at once."""
    async with demo.async_client(headers=ALICE) as client:
        return await asyncio.gather(
            *(client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": k}) for k in keys)
        )


async def burst(demo: Demo, keys: list[str]) -> list[int]:
    return [answer.status_code for answer in await post_all(demo, keys)]


async def retry_until_created(demo: Demo, keys: list[str], seconds: float) -> list[int]:
    """Each key's payment sent again, a second apart, until it answers 201 or time runs out."""
    statuses = dict.fromkeys(keys, 0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pending = [key for key, status in statuses.items() if status != 201]
        if not pending:
            break
        statuses.update(zip(pending, await burst(demo, pending), strict=True))
        await asyncio.sleep(1)
    return list(statuses.values())


@dataclasses.dataclass(frozen=True)
class Server:
    """A private database server: its URL, what kills it and what starts it again."""

    url: str
    stop: Callable[[], None]
    start: Callable[[], None]

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def private_server(kind: str) -> Iterator[Server]:
    """A private server of ``kind``, running."""
    if kind == "postgresql":
        from tests._private_postgres import PrivatePostgresUnavailable, private_postgres

        try:
            with private_postgres() as cluster:
                yield Server(cluster.url, lambda: cluster.stop("immediate"), cluster.start)
        except PrivatePostgresUnavailable as exc:
            unreachable("a private PostgreSQL", exc)
        return
    if kind == "redis":  # the keys; the payments in SQLite under the demo's data dir
        from tests._private_redis import PERSISTENT, RedisServer

        if shutil.which("redis-server") is None:
            unreachable("redis-server", FileNotFoundError("redis-server"))
        with tempfile.TemporaryDirectory() as directory:
            redis = RedisServer("redis-server", Path(directory), PERSISTENT)
            redis.start()
            try:
                yield Server(redis.url, redis.kill, redis.start)
            finally:
                redis.kill()
        return
    from tests._private_mariadb import PrivateMariaDBUnavailable, private_mariadb

    try:
        with private_mariadb() as server:
            # stop is a SIGKILL: every connection of both pools drops at once
            yield Server(server.url, server.stop, server.start)
    except PrivateMariaDBUnavailable as exc:
        unreachable("a private MariaDB", exc)


SQL_KINDS = [
    pytest.param("postgresql", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mysql),
]
EVERY_KIND = [*SQL_KINDS, pytest.param("redis", marks=pytest.mark.redis)]


@pytest.mark.parametrize("kind", SQL_KINDS)
def test_a_restart_of_the_database_under_the_demo_refuses_no_request(
    kind: str, tmp_path: Path
) -> None:
    with (
        private_server(kind) as server,
        run_demo(tmp_path / "data", "--pool-size", "4", database_url=server.url) as demo,
    ):
        before = [new_key() for _ in range(BURST)]
        first = asyncio.run(burst(demo, before))
        server.restart()
        second = asyncio.run(burst(demo, [new_key() for _ in range(BURST)]))
        replays = asyncio.run(burst(demo, before))
        charges = len(demo.charges())

    assert first == [201] * BURST
    assert second == [201] * BURST  # was: a 503 for each pooled connection that died
    assert replays == [201] * BURST
    assert charges == 2 * BURST


@pytest.mark.parametrize("kind", EVERY_KIND)
def test_healthz_answers_503_while_the_key_store_is_down_and_200_once_it_is_back(
    kind: str, tmp_path: Path
) -> None:
    """/healthz reads the key store on a connection of its own: a problem+json 503 while
    the server is down (on Redis too, where the payments' SQLite is still up), then 200."""
    with (
        private_server(kind) as server,
        run_demo(tmp_path / "data", database_url=server.url) as demo,
        demo.client() as client,
    ):
        server.stop()
        try:
            down = client.get("/healthz", timeout=30)
        finally:
            server.start()
        deadline = time.monotonic() + 30
        while (up := client.get("/healthz", timeout=30)).status_code != 200:
            assert time.monotonic() < deadline, up.text
            time.sleep(0.2)

    assert down.status_code == 503, down.text
    assert down.headers["content-type"] == "application/problem+json"
    assert down.json()["type"].endswith("/store-unavailable")
    assert up.json() == {"status": "ok"}


#: Longer than the PostgreSQL pool's checkout timeout (5 s): a start that gave up on its
#: first timed-out checkout would exit before the database is back.
DOWN_SECONDS = 7.0


@pytest.mark.parametrize("kind", EVERY_KIND)
def test_a_demo_started_while_its_database_is_down_comes_up_with_it(
    kind: str, tmp_path: Path
) -> None:
    with private_server(kind) as server:
        server.stop()
        back = threading.Timer(DOWN_SECONDS, server.start)
        back.start()
        try:
            with run_demo(tmp_path / "data", database_url=server.url, startup_seconds=60) as demo:
                back.join()
                answers = asyncio.run(burst(demo, [new_key() for _ in range(BURST)]))
                charges = len(demo.charges())
                log = demo.log.read_text()
        finally:
            back.join()

    assert answers == [201] * BURST
    assert charges == BURST
    assert "the database is unavailable at start-up" in log


@pytest.mark.redis
def test_a_restart_of_redis_under_the_demo_quarantines_new_claims_and_replays_throughout(
    tmp_path: Path,
) -> None:
    """Redis restarted (here with every write fsynced, but the store cannot know that) may
    have lost claims whose requests still run: new claims answer 503 + Retry-After until
    the stale threshold has passed since the boot (2 x 1 s + 10 s here), while the
    payments from before replay at once; then each new key runs once."""
    with (
        private_server("redis") as server,
        run_demo(tmp_path / "data", "--request-timeout", "1", database_url=server.url) as demo,
    ):
        before = [new_key() for _ in range(BURST)]
        first = asyncio.run(burst(demo, before))
        server.restart()
        after = [new_key() for _ in range(BURST)]
        quarantined = asyncio.run(post_all(demo, after))
        replays = asyncio.run(post_all(demo, before))
        charges_in_quarantine = len(demo.charges())
        retried = asyncio.run(retry_until_created(demo, after, seconds=40))
        charges = len(demo.charges())

    assert first == [201] * BURST
    assert [answer.status_code for answer in quarantined] == [503] * BURST
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in quarantined)
    assert [(r.status_code, r.headers.get("idempotent-replayed")) for r in replays] == [
        (201, "true")
    ] * BURST
    assert charges_in_quarantine == BURST
    assert retried == [201] * BURST
    assert charges == 2 * BURST
