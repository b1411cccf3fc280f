"""
The Redis store beyond the shared contract: what only a Redis store has to show.

The claim behaves as ``SET NX PX <lease>`` (the lease is the policy's stale
threshold), settled records keep their own TTL, a replay is one round trip,
the store refuses the caller's transaction at configuration time, and an
unreachable or vanishing server is a 503, never a second execution.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from idemflow import (
    AsyncIdempotency,
    ConfigurationError,
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Policy,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.testing import FrozenClock
from tests.backends import REDIS_URL, redis_client
from tests.conftest import unreachable
from tests.stores._race import Recorder, assert_exactly_once, race_processes, race_threads

redis = pytest.importorskip("redis")
from redis.connection import Connection  # noqa: E402

from idemflow.stores.redis import AsyncRedisStore, RedisStore, open_redis  # noqa: E402

pytestmark = pytest.mark.redis

POLICY = Policy(request_timeout=5, retention=3600)  # lease: 2 × 5 s + 10 s = 20 s
CREATED = Response.json(201, {"id": "pay_1"})


def intent(key: str = "k-1", fp: str = "fp-1") -> Intent:
    return Intent("alice", key, fp, endpoint="POST /payments")


@pytest.fixture
def store(table_name: str) -> Iterator[RedisStore]:
    client = redis_client()
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        unreachable("Redis", exc)
    made = RedisStore(client, policy=POLICY, prefix=table_name)
    yield made
    for key in client.scan_iter(match=f"{table_name}:*"):
        client.delete(key)
    made.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def own_redis_server(directory: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of our own on a free loopback port, so we may stop it."""
    if shutil.which("redis-server") is None:
        unreachable("redis-server", FileNotFoundError("redis-server"))
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis_client(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield process, url
    finally:
        process.terminate()
        process.wait(timeout=10)


# --- the claim and the record's life -----------------------------------------


def test_claim_is_set_nx_with_the_policy_lease(store: RedisStore) -> None:
    """An in-progress record lives for the stale threshold, then vanishes by itself."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600)
    ttl_ms = store.client.pttl(store.layout.record_key("alice", "k-1"))

    assert claim.owned
    assert store.layout.lease_ms == 20_000 == POLICY.stale_seconds * 1000
    assert 19_000 < ttl_ms <= 20_000


def test_settled_record_keeps_its_own_ttl_for_the_retention(store: RedisStore) -> None:
    """Completion replaces the lease with the rest of the retention period."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600)
    clock.advance(10)
    store.complete(claim.record, State.COMPLETED, CREATED, clock())

    ttl_ms = store.client.pttl(store.layout.record_key("alice", "k-1"))
    assert 3_589_000 < ttl_ms <= 3_590_000


def test_released_record_waits_for_the_retry_of_the_same_request(store: RedisStore) -> None:
    """Released keeps the record: the same request takes it over, another one gets 422."""
    clock = FrozenClock()
    idem = Idempotency(store, POLICY, clock=clock)
    idem.run(intent(), lambda attempt: Response(503))
    record = store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.RELEASED

    with pytest.raises(KeyReused):
        idem.run(intent(fp="fp-other"), lambda attempt: CREATED)
    retry = idem.run(intent(), lambda attempt: CREATED)
    assert (retry.replayed, retry.record.attempt, retry.record.created_at) == (
        False,
        2,
        record.created_at,
    )


def test_a_lease_that_ran_out_ends_the_claim(store: RedisStore) -> None:
    """Past the lease the crashed claim is gone: a retry runs, the old owner cannot complete."""
    clock = FrozenClock()
    crashed = store.claim(intent(), "lease-a", clock(), clock() + 3600).record
    clock.advance(19)
    assert not store.claim(intent(), "lease-b", clock(), clock() + 3600).owned
    clock.advance(2)

    retry = store.claim(intent(), "lease-c", clock(), clock() + 3600)

    assert retry.owned
    assert retry.record.attempt == 1  # a fresh claim, as after SET NX on an expired key
    with pytest.raises(LeaseLost):
        store.complete(crashed, State.COMPLETED, CREATED, clock())


def test_checkpoint_renews_the_lease(store: RedisStore) -> None:
    """A checkpoint counts as life: the lease runs from the checkpoint."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600)
    clock.advance(15)
    store.checkpoint(claim.record, "charged", clock())
    clock.advance(15)

    assert not store.claim(intent(), "lease-b", clock(), clock() + 3600).owned
    store.complete(claim.record, State.COMPLETED, CREATED, clock())


def test_every_script_is_safe_to_retry(store: RedisStore) -> None:
    """A client that resends a script after a lost reply finds its own result, not a loss."""
    clock = FrozenClock()
    first = store.claim(intent(), "lease-a", clock(), clock() + 3600)
    again = store.claim(intent(), "lease-a", clock(), clock() + 3600)
    assert (first.owned, again.owned) == (True, True)
    assert again.record.id == first.record.id

    store.complete(first.record, State.COMPLETED, CREATED, clock())
    store.complete(first.record, State.COMPLETED, CREATED, clock())  # no LeaseLost

    other = store.claim(intent("k-2"), "lease-b", clock(), clock() + 3600).record
    assert store.release(other, clock()) is True
    assert store.release(other, clock()) is True


class CountingConnection(Connection):
    """Counts what the client sends: one entry per command written to the socket."""

    sent: ClassVar[list[bytes]] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        chunks = [command] if isinstance(command, bytes | str) else list(command)
        first = chunks[0] if isinstance(chunks[0], bytes) else str(chunks[0]).encode()
        CountingConnection.sent.append(first.split(b"\r\n")[2].upper())
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def test_replay_is_one_round_trip(store: RedisStore) -> None:
    """Answering a retry from a stored record sends exactly one command: the claim script."""
    idem = Idempotency(store, POLICY)
    idem.run(intent(), lambda attempt: CREATED)
    pool = redis.ConnectionPool.from_url(REDIS_URL, connection_class=CountingConnection)
    counting = RedisStore(
        redis.Redis(connection_pool=pool), policy=POLICY, prefix=store.layout.prefix
    )
    counting.client.ping()
    CountingConnection.sent.clear()

    outcome = Idempotency(counting, POLICY).run(intent(), lambda attempt: Response(500))

    assert (outcome.replayed, outcome.response) == (True, CREATED)
    assert CountingConnection.sent == [b"EVALSHA"]
    counting.close()


def test_a_server_that_lost_its_scripts_gets_them_again(tmp_path: Path) -> None:
    """After SCRIPT FLUSH (or a restart) the first call reloads the script and still decides."""
    with own_redis_server(tmp_path) as (_, url):
        store = RedisStore(redis_client(url), policy=POLICY, prefix="flushed")
        store.client.script_flush()
        clock = FrozenClock()

        first = store.claim(intent(), "lease-a", clock(), clock() + 60)
        second = store.claim(intent(), "lease-b", clock(), clock() + 60)
        store.close()
    assert (first.owned, second.owned) == (True, False)


def test_keys_are_case_and_space_exact(store: RedisStore) -> None:
    """'Key' and 'key', 'k' and 'k ' are four different intents."""
    idem = Idempotency(store, POLICY)
    bodies = [
        idem.run(intent(k), Recorder(Response(201, k.encode()))) for k in ("Key", "key", "k", "k ")
    ]

    assert [o.replayed for o in bodies] == [False] * 4
    assert {o.response.body for o in bodies} == {b"Key", b"key", b"k", b"k "}


# --- configuration ---------------------------------------------------------------


def test_a_transaction_is_refused_before_anything_is_claimed(store: RedisStore) -> None:
    """No shared transaction: passing one is a ConfigurationError, and no key is claimed."""
    handler = Recorder()

    with pytest.raises(ConfigurationError, match="cannot share the caller's transaction"):
        Idempotency(store, POLICY).run(intent(), handler, transaction=object())  # type: ignore[arg-type]
    assert handler.calls == []
    assert store.get("alice", "k-1") is None


def test_a_decoding_client_is_refused_at_construction() -> None:
    """Bodies are bytes: a client with decode_responses=True is a configuration error."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    with pytest.raises(ConfigurationError, match="decode_responses"):
        RedisStore(client, policy=POLICY)
    client.close()


def test_lease_follows_the_policy() -> None:
    """The lease is the policy's stale threshold; without a policy, the default one's."""
    client = redis_client()
    assert RedisStore(client, policy=Policy(request_timeout=60)).layout.lease_ms == 130_000
    assert RedisStore(client).layout.lease_ms == Policy().stale_seconds * 1000
    client.close()


# --- outages ------------------------------------------------------------------------


def test_unreachable_redis_is_store_unavailable() -> None:
    """Nothing listening on the port: 503, and the handler never runs."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = open_redis(url, policy=POLICY)
    assert isinstance(store, RedisStore)
    handler = Recorder()

    with pytest.raises(StoreUnavailable) as raised:
        Idempotency(store, POLICY).run(intent(), handler)
    assert raised.value.status == 503
    assert handler.calls == []


def test_redis_stopping_mid_request_is_a_503_not_a_second_execution(tmp_path: Path) -> None:
    """The server dies while the handler runs: the completion fails closed, nothing reruns."""
    with own_redis_server(tmp_path) as (process, url):
        store = RedisStore(redis_client(url), policy=POLICY, prefix="outage")
        idem = Idempotency(store, POLICY)
        calls: list[object] = []

        def handler(attempt: Any) -> Response:
            calls.append(attempt)
            process.terminate()
            process.wait(timeout=10)
            return CREATED

        with pytest.raises(StoreUnavailable):
            idem.run(intent(), handler)
        with pytest.raises(StoreUnavailable):  # the retry while Redis is down
            idem.run(intent(), handler)
        store.close()
    assert len(calls) == 1


# --- async twin ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_store_runs_replays_and_refuses(table_name: str) -> None:
    """AsyncRedisStore: one execution, a verbatim replay, 422 for another request, 409 in flight."""
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await client.ping()
    except redis.exceptions.ConnectionError as exc:
        unreachable("Redis", exc)
    store = AsyncRedisStore(client, policy=POLICY, prefix=table_name)
    idem = AsyncIdempotency(store, POLICY)
    seen: list[BaseException] = []

    async def handler(attempt: Any) -> Response:
        with pytest.raises(InProgress) as raised:
            await idem.run(intent(), handler)
        seen.append(raised.value)
        await attempt.checkpoint("halfway")
        return CREATED

    try:
        first = await idem.run(intent(), handler)
        replay = await idem.run(intent(), handler)
        with pytest.raises(KeyReused):
            await idem.run(intent(fp="fp-other"), handler)
        with pytest.raises(ConfigurationError):
            await idem.run(intent("k-2"), handler, transaction=object())  # type: ignore[arg-type]
        record = await store.get("alice", "k-1")
    finally:
        async for key in client.scan_iter(match=f"{table_name}:*"):
            await client.delete(key)
        await store.close()
    assert (first.replayed, replay.replayed, replay.response) == (False, True, CREATED)
    assert len(seen) == 1
    assert record is not None
    assert record.recovery_point == "halfway"


# --- races ------------------------------------------------------------------------------


@pytest.mark.slow
def test_fifty_threads_race_for_each_key(store: RedisStore, table_name: str) -> None:
    """60 threads claim one key at once, five keys in a row: one execution per key."""
    for counts in race_threads(store, table_name, rounds=5, claimants=60):
        assert_exactly_once(counts, 60)


@pytest.mark.slow
def test_four_processes_race_for_each_key(store: RedisStore, table_name: str) -> None:
    """4 processes × 15 threads claim one key at once, three keys: one execution per key."""
    totals = race_processes(
        ("redis", (table_name, REDIS_URL)),
        table_name,
        processes=4,
        rounds=3,
        claimants_per_process=15,
    )
    for counts in totals.values():
        assert_exactly_once(counts, 60)
