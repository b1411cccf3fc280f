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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import unreachable
from tests.http.conftest import ALICE, PAYMENT, Demo, new_key, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: More concurrent requests than the demo's pool holds connections, so every pooled
#: connection has served (and dies with the server).
BURST = 12


async def burst(demo: Demo, keys: list[str]) -> list[int]:
    async with demo.async_client(headers=ALICE) as client:
        answers = await asyncio.gather(
            *(client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": k}) for k in keys)
        )
    return [answer.status_code for answer in answers]


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
    from tests._private_mariadb import PrivateMariaDBUnavailable, private_mariadb

    try:
        with private_mariadb() as server:
            # stop is a SIGKILL: every connection of both pools drops at once
            yield Server(server.url, server.stop, server.start)
    except PrivateMariaDBUnavailable as exc:
        unreachable("a private MariaDB", exc)


KINDS = pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ],
)


@KINDS
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


#: Longer than the PostgreSQL pool's checkout timeout (5 s): a start that gave up on its
#: first timed-out checkout would exit before the database is back.
DOWN_SECONDS = 7.0


@KINDS
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
