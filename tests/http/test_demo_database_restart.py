"""
The demo on a database of its own, restarted between two bursts of payments: every
pooled connection died with the server. On PostgreSQL the demo takes the request's
connection through the store's checkout (``store.connection``), which skips a connection
the server closed; on MariaDB the demo's own business pool asks
``idemflow.stores.mysql.closed_by_server`` of each idle connection it hands out, as the
store's pool does. Seen from outside: no request after the restart is refused, each
charges once, and the payments from before the restart replay.
"""

from __future__ import annotations

import asyncio
import contextlib
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


@contextlib.contextmanager
def restartable(kind: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A private server of ``kind``: its URL, and what kills it and starts it again."""
    if kind == "postgresql":
        from tests._private_postgres import PrivatePostgresUnavailable, private_postgres

        try:
            with private_postgres() as cluster:

                def restart_postgresql() -> None:
                    cluster.stop("immediate")
                    cluster.start()

                yield cluster.url, restart_postgresql
        except PrivatePostgresUnavailable as exc:
            unreachable("a private PostgreSQL", exc)
        return
    from tests._private_mariadb import PrivateMariaDBUnavailable, private_mariadb

    try:
        with private_mariadb() as server:

            def restart_mariadb() -> None:
                server.stop()  # SIGKILL: every connection of both pools drops at once
                server.start()

            yield server.url, restart_mariadb
    except PrivateMariaDBUnavailable as exc:
        unreachable("a private MariaDB", exc)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ],
)
def test_a_restart_of_the_database_under_the_demo_refuses_no_request(
    kind: str, tmp_path: Path
) -> None:
    with (
        restartable(kind) as (url, restart),
        run_demo(tmp_path / "data", "--pool-size", "4", database_url=url) as demo,
    ):
        before = [new_key() for _ in range(BURST)]
        first = asyncio.run(burst(demo, before))
        restart()
        second = asyncio.run(burst(demo, [new_key() for _ in range(BURST)]))
        replays = asyncio.run(burst(demo, before))
        charges = len(demo.charges())

    assert first == [201] * BURST
    assert second == [201] * BURST  # was: a 503 for each pooled connection that died
    assert replays == [201] * BURST
    assert charges == 2 * BURST
