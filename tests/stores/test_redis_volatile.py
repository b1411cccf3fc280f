"""
A Redis (or Valkey) that loses data: refused at start-up, found out while running.

Restarted without persistence, a server forgets every claim: a request that
claimed before the restart may still be running when its retry finds no
record and runs again. So a store refuses a server that keeps neither an AOF
nor RDB snapshots unless told ``allow_volatile=True``, and while running it
notices a bucket whose epoch key vanished and answers its claims 503 +
``Retry-After`` until the stale threshold has passed. Each test runs a
private ``redis-server`` or ``valkey-server`` of its own, restarted by PID.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    ConfigurationError,
    Idempotency,
    InProgress,
    LeaseLost,
    Response,
    StoreUnavailable,
)
from idemflow.testing import FrozenClock
from tests._private_redis import VOLATILE, RedisServer
from tests._redis_cluster import ClusterUnavailable, valkey_server
from tests.backends import redis_client
from tests.conftest import unreachable
from tests.factories import POLICY, intent
from tests.stores._race import Recorder

redis = pytest.importorskip("redis")
from idemflow.stores.redis import RedisStore  # noqa: E402
from idemflow.stores.urls import open_store  # noqa: E402

pytestmark = pytest.mark.redis

CREATED = Response(201, b"created")


def binary(name: str) -> str:
    if name == "valkey-server":
        try:
            return valkey_server()
        except ClusterUnavailable as exc:
            unreachable("valkey-server", exc)
    if shutil.which(name) is None:
        unreachable(name, FileNotFoundError(name))
    return name


@contextlib.contextmanager
def server(name: str, directory: Path, *options: str) -> Iterator[RedisServer]:
    running = RedisServer(binary(name), directory, options)
    running.start()
    try:
        yield running
    finally:
        running.stop()


SERVERS = ["redis-server", "valkey-server"]


@pytest.mark.parametrize("name", SERVERS)
def test_a_server_without_persistence_is_refused_unless_acknowledged(
    name: str, tmp_path: Path
) -> None:
    """No AOF and no RDB: the first claim refuses the server, the handler never runs.
    ``allow_volatile=True`` (or ``?allow_volatile=1``) accepts it."""
    with server(name, tmp_path, *VOLATILE) as running:
        handler = Recorder()
        refused = RedisStore(redis_client(running.url), prefix="v")
        with pytest.raises(ConfigurationError, match="allow_volatile"):
            Idempotency(refused, POLICY).run(intent(), handler)
        assert handler.calls == []
        assert refused.get("alice", "k-1") is None

        accepted = RedisStore(redis_client(running.url), prefix="v", allow_volatile=True)
        assert not Idempotency(accepted, POLICY).run(intent(), handler).replayed
        by_url: Any = open_store(running.url + "?allow_volatile=1", table="v")
        assert Idempotency(by_url, POLICY).run(intent(), handler).replayed
        assert len(handler.calls) == 1
        for store in (refused, accepted, by_url):
            store.close()


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("redis-server", ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")),
        ("redis-server", ("--save", "3600 1", "--appendonly", "no")),
        ("valkey-server", ("--save", "", "--appendonly", "yes", "--appendfsync", "always")),
    ],
    ids=["redis-aof", "redis-rdb", "valkey-aof"],
)
def test_a_server_that_persists_is_accepted(
    name: str, options: tuple[str, ...], tmp_path: Path
) -> None:
    """AOF (any fsync policy) or RDB snapshots: the store starts without being told."""
    with server(name, tmp_path, *options) as running:
        store = RedisStore(redis_client(running.url), prefix="p")
        handler = Recorder()
        assert not Idempotency(store, POLICY).run(intent(), handler).replayed
        assert Idempotency(store, POLICY).run(intent(), handler).replayed
        store.close()
    assert len(handler.calls) == 1


@contextlib.contextmanager
def requests_in_flight(idem: Idempotency, keys: list[str]) -> Iterator[dict[str, str]]:
    """A request per key, each in its own thread, its handler holding the claim until the
    block ends; entered once every one has claimed. Yields how each ended, "completed" or
    "lease lost" (filled in once the block is left: the handlers are released and joined
    on the way out, so a failing block does not leave them waiting)."""
    release, claimed = threading.Event(), threading.Semaphore(0)
    ended: dict[str, str] = {}

    def running_request(key: str) -> None:
        def handler(attempt: Any) -> Response:
            claimed.release()
            assert release.wait(60)
            return CREATED

        try:
            idem.run(intent(key), handler)
            ended[key] = "completed"
        except LeaseLost:
            ended[key] = "lease lost"

    threads = [threading.Thread(target=running_request, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    try:
        for _ in keys:
            assert claimed.acquire(timeout=60)
        yield ended
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=60)


@pytest.mark.parametrize("name", SERVERS)
def test_claims_in_flight_across_a_restart_without_persistence_never_run_twice(
    name: str, tmp_path: Path
) -> None:
    """20 requests have claimed and are still running when the server restarts empty.
    Their retries are told 503 + Retry-After (the stale threshold) instead of running
    again beside them; their own completions are lost (LeaseLost: the record is gone).
    Once the threshold has passed, a retry runs: what was settled before a loss is
    lost with it, and no store can save that."""
    clock = FrozenClock()
    keys = [f"k-{n}" for n in range(20)]
    with server(name, tmp_path, *VOLATILE) as running:
        store = RedisStore(
            redis_client(running.url),
            policy=POLICY,
            prefix="lost",
            clock="caller",
            allow_volatile=True,
        )
        idem = Idempotency(store, POLICY, clock=clock)
        with requests_in_flight(idem, keys) as first:
            running.restart()  # every claim forgotten while its request still runs
            retries = Recorder()
            answers = []
            for key in keys:
                with pytest.raises(StoreUnavailable) as raised:
                    idem.run(intent(key), retries)
                answers.append(raised.value)

        assert retries.calls == []  # nothing ran beside a request still in flight
        assert {a.status for a in answers} == {503}
        assert all(1 <= a.retry_after <= POLICY.stale_seconds + 1 for a in answers)
        assert first == dict.fromkeys(keys, "lease lost")

        clock.advance(POLICY.stale_seconds + 1)
        for key in keys:
            assert not idem.run(intent(key), retries).replayed
        assert len(retries.calls) == len(keys)
        store.close()


def test_a_store_started_on_an_existing_server_does_not_quarantine(tmp_path: Path) -> None:
    """Starting (or restarting) the app on a server that kept its data is no loss:
    the epochs are there, claims go on at once."""
    with server("redis-server", tmp_path, *VOLATILE) as running:
        first = RedisStore(redis_client(running.url), prefix="e", allow_volatile=True)
        Idempotency(first, POLICY).run(intent(), Recorder())
        first.close()
        second = RedisStore(redis_client(running.url), prefix="e", allow_volatile=True)
        assert Idempotency(second, POLICY).run(intent(), Recorder()).replayed
        assert not Idempotency(second, POLICY).run(intent("k-2"), Recorder()).replayed
        second.close()


# --- a restart that keeps the data: the server's boot (INFO's run_id) -------------------

PERSISTENT = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")


def lose(store: Any, *keys: str) -> None:
    """What a crash takes from an AOF fsynced every second: the last writes (these claims)."""
    for key in keys:
        assert store.client.delete(store.layout.record_key("alice", key)) == 1


@pytest.mark.parametrize("name", SERVERS)
def test_claims_in_flight_across_a_restart_with_persistence_never_run_twice(
    name: str, tmp_path: Path
) -> None:
    """Five requests are running when a server with an AOF restarts (a new run_id); the
    claims of three of them were its last writes, lost as a crash with ``appendfsync
    everysec`` loses them. No retry runs beside its request: where the record is gone
    the claim would write, and is told 503 + Retry-After until the stale threshold has
    passed; where it is kept, 409. A settled key still replays and the kept requests
    complete during the quarantine; then the lost ones run once."""
    clock = FrozenClock()
    keys = [f"k-{n}" for n in range(5)]
    lost, kept = keys[:3], keys[3:]
    with server(name, tmp_path, *PERSISTENT) as running:
        store = RedisStore(redis_client(running.url), policy=POLICY, prefix="boot", clock="caller")
        idem = Idempotency(store, POLICY, clock=clock)
        idem.run(intent("done"), Recorder())
        with requests_in_flight(idem, keys) as first:
            running.restart()  # the data kept, the boot new
            lose(store, *lost)
            retries = Recorder()
            refused = []
            for key in [*lost, "fresh"]:
                with pytest.raises(StoreUnavailable, match="restarted or lost data") as raised:
                    idem.run(intent(key), retries)
                refused.append(raised.value)
            for key in kept:
                with pytest.raises(InProgress):
                    idem.run(intent(key), retries)
            assert idem.run(intent("done"), retries).replayed

        assert retries.calls == []
        assert all(1 <= a.retry_after <= POLICY.stale_seconds + 1 for a in refused)
        assert first == {**dict.fromkeys(lost, "lease lost"), **dict.fromkeys(kept, "completed")}
        clock.advance(POLICY.stale_seconds + 1)
        for key in [*lost, "fresh"]:
            assert not idem.run(intent(key), retries).replayed
        assert [attempt.record.key for attempt in retries.calls] == [*lost, "fresh"]
        store.close()


def test_a_restart_is_found_by_a_store_started_after_it_and_ends_a_threshold_after_the_boot(
    tmp_path: Path,
) -> None:
    """The epochs remember the boot they were written on, so a store that starts only
    after the restart refuses too; a second store finding the same restart later does
    not start the quarantine again (it ends a threshold after the boot). A SCRIPT FLUSH
    (the same boot) or the app restarting (the same server) quarantines nothing."""
    clock = FrozenClock()
    with server("redis-server", tmp_path, *PERSISTENT) as running:

        def store() -> RedisStore:
            client = redis_client(running.url)
            return RedisStore(client, policy=POLICY, prefix="late", clock="caller")

        before = store()
        Idempotency(before, POLICY, clock=clock).run(intent("k-1"), Recorder())
        before.client.script_flush()
        assert not Idempotency(before, POLICY, clock=clock).run(intent("k-2"), Recorder()).replayed
        before.close()
        again = store()
        assert not Idempotency(again, POLICY, clock=clock).run(intent("k-3"), Recorder()).replayed
        again.close()

        running.restart()
        after = store()
        idem = Idempotency(after, POLICY, clock=clock)
        with pytest.raises(StoreUnavailable, match="restarted or lost data") as found:
            idem.run(intent("k-4"), Recorder())
        assert idem.run(intent("k-1"), Recorder()).replayed
        clock.advance(POLICY.stale_seconds / 2)
        later = store()
        with pytest.raises(StoreUnavailable) as still:
            Idempotency(later, POLICY, clock=clock).run(intent("k-4"), Recorder())
        clock.advance(POLICY.stale_seconds / 2 + 1)
        assert not Idempotency(later, POLICY, clock=clock).run(intent("k-4"), Recorder()).replayed
        after.close()
        later.close()
    assert found.value.retry_after <= POLICY.stale_seconds + 1
    assert still.value.retry_after <= POLICY.stale_seconds / 2 + 1


@pytest.mark.anyio
@pytest.mark.parametrize("name", SERVERS)
async def test_the_async_store_finds_a_restart_too(name: str, tmp_path: Path) -> None:
    """AsyncRedisStore: a request in flight whose claim a restart lost is not run again
    beside it (503 + Retry-After), a settled key replays; after the threshold it runs."""
    import asyncio

    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from idemflow import AsyncIdempotency
    from idemflow.stores.redis import AsyncRedisStore

    clock = FrozenClock()
    with server(name, tmp_path, *PERSISTENT) as running:
        client = Redis.from_url(
            running.url, socket_connect_timeout=2, socket_timeout=5, retry=Retry(NoBackoff(), 1)
        )
        store = AsyncRedisStore(client, policy=POLICY, prefix="aboot", clock="caller")
        idem = AsyncIdempotency(store, POLICY, clock=clock)
        calls: list[str] = []
        release, claimed = asyncio.Event(), asyncio.Event()

        async def handler(attempt: Any) -> Response:
            calls.append(attempt.record.key)
            claimed.set()
            await asyncio.wait_for(release.wait(), 60)
            return CREATED

        release.set()
        await idem.run(intent("done"), handler)
        release.clear()
        claimed.clear()
        in_flight = asyncio.ensure_future(idem.run(intent("k-1"), handler))
        await asyncio.wait_for(claimed.wait(), 30)
        running.restart()
        sync = RedisStore(redis_client(running.url), prefix="aboot", allow_volatile=True)
        lose(sync, "k-1")
        with pytest.raises(StoreUnavailable, match="restarted or lost data") as raised:
            await idem.run(intent("k-1"), handler)
        assert (await idem.run(intent("done"), handler)).replayed
        release.set()
        with pytest.raises(LeaseLost):
            await in_flight
        clock.advance(POLICY.stale_seconds + 1)
        assert not (await idem.run(intent("k-1"), handler)).replayed
        await store.close()
        sync.close()
    assert calls == ["done", "k-1", "k-1"]
    assert 1 <= raised.value.retry_after <= POLICY.stale_seconds + 1


# --- a loss found once arms every bucket it took -----------------------------------------


def lose_everything(loss: str, running: RedisServer, store: RedisStore) -> None:
    if loss == "restart":
        running.restart()  # without persistence: every key and the script cache gone
    else:
        store.client.flushall()


@pytest.mark.parametrize("name", SERVERS)
@pytest.mark.parametrize("loss", ["restart", "flushall"])
def test_after_a_loss_every_bucket_runs_a_threshold_after_the_loss_was_found(
    name: str, loss: str, tmp_path: Path
) -> None:
    """The first claim after a loss finds it; 40 fresh keys are then asked for the first
    time at every half second, until a second past the stale threshold, and retried at
    each. Every bucket's quarantine ends a threshold after that first discovery, not after
    its own first claim: each key runs at the first try from then on, none before, every
    503's Retry-After points there; the request in flight across the loss is refused
    throughout, and its retry runs once after."""
    clock = FrozenClock()
    threshold, step = POLICY.stale_seconds, 0.5
    steps = int((threshold + 1) / step)
    fresh = [f"fresh-{n}" for n in range(40)]
    ran_at: dict[str, float] = {}
    refused: list[tuple[float, int]] = []  # (asked at, Retry-After)
    retries = Recorder()
    with server(name, tmp_path, *VOLATILE) as running:
        store = RedisStore(
            redis_client(running.url),
            policy=POLICY,
            prefix="found",
            clock="caller",
            allow_volatile=True,
        )
        idem = Idempotency(store, POLICY, clock=clock)
        with requests_in_flight(idem, ["held"]) as first:
            lose_everything(loss, running, store)
            found_at = clock()
            with pytest.raises(StoreUnavailable, match="restarted or lost data"):
                idem.run(intent("held"), retries)  # finds the loss
            for done in range(1, steps + 1):
                clock.advance(step)
                asked = fresh[: len(fresh) * done // steps]
                held = ["held"] if clock() < found_at + threshold else []
                for key in [key for key in asked if key not in ran_at] + held:
                    try:
                        idem.run(intent(key), retries)
                        ran_at[key] = clock()
                    except StoreUnavailable as exc:
                        refused.append((clock(), exc.retry_after))
        assert first == {"held": "lease lost"}
        assert not idem.run(intent("held"), retries).replayed
        store.close()

    ends = found_at + threshold  # a threshold after the discovery, in every bucket
    assert sorted(ran_at) == sorted(fresh)  # "held" never ran beside its request
    assert all(ends <= at <= ends + 1 for at in ran_at.values())
    assert all(ends <= at + after <= ends + 1 for at, after in refused)
    assert [attempt.record.key for attempt in retries.calls].count("held") == 1
    assert len(retries.calls) == len(fresh) + 1


@pytest.mark.anyio
async def test_the_async_store_arms_every_bucket_at_the_first_claim_that_finds_a_loss(
    tmp_path: Path,
) -> None:
    """AsyncRedisStore, after a FLUSHALL: a fresh key asked first half a threshold after the
    claim that found the loss is refused only until a threshold after that discovery."""
    from redis.asyncio import Redis

    from idemflow import AsyncIdempotency
    from idemflow.stores.redis import AsyncRedisStore

    clock = FrozenClock()
    calls: list[str] = []

    async def handler(attempt: Any) -> Response:
        calls.append(attempt.record.key)
        return CREATED

    with server("redis-server", tmp_path, *VOLATILE) as running:
        client = Redis.from_url(running.url)
        store = AsyncRedisStore(
            client, policy=POLICY, prefix="afound", clock="caller", allow_volatile=True
        )
        idem = AsyncIdempotency(store, POLICY, clock=clock)
        await idem.run(intent("before"), handler)
        await client.flushall()
        with pytest.raises(StoreUnavailable, match="restarted or lost data"):
            await idem.run(intent("before"), handler)  # finds the loss
        clock.advance(POLICY.stale_seconds / 2)
        with pytest.raises(StoreUnavailable) as later:
            await idem.run(intent("fresh"), handler)
        clock.advance(POLICY.stale_seconds / 2)
        assert not (await idem.run(intent("fresh"), handler)).replayed
        await store.close()
    assert later.value.retry_after == math.ceil(POLICY.stale_seconds / 2)
    assert calls == ["before", "fresh"]
