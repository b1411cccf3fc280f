"""
The Redis store, unchanged, on a real three-master Redis Cluster.

The shared contract runs here through the ``redis-cluster`` backend; these
tests add what a cluster adds: records spread over every node (no hot
principal), each record's keys in one slot, races across nodes, and a dead
master answered with 503.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest

from idemflow import Idempotency, Intent, Policy, Response, StoreUnavailable
from tests._redis_cluster import ClusterUnavailable, RedisClusterProcess, shared_cluster
from tests.backends import redis_client
from tests.conftest import unreachable
from tests.stores._race import Recorder, assert_exactly_once, race_processes, race_threads

pytest.importorskip("redis")
from idemflow.stores.redis import RedisStore

pytestmark = pytest.mark.redis

POLICY = Policy(request_timeout=5, retention=3600)
CREATED = Response(201, b"ok")


def started() -> RedisClusterProcess:
    try:
        return shared_cluster()
    except (ClusterUnavailable, OSError) as exc:
        unreachable("Redis Cluster", exc)
        raise  # unreachable() never returns


@pytest.fixture
def cluster_store(table_name: str) -> Iterator[RedisStore]:
    cluster = started()
    store = RedisStore(redis_client(cluster.url, cluster=True), policy=POLICY, prefix=table_name)
    yield store
    for key in store.client.scan_iter(match=f"{table_name}:*"):
        store.client.delete(key)
    store.close()


def node_of(store: RedisStore, key: bytes) -> str:
    node = store.client.get_node_from_key(key)
    return f"{node.host}:{node.port}"


def test_records_of_one_principal_spread_over_every_master(cluster_store: RedisStore) -> None:
    """One busy principal is not one hot node: its keys land on all three masters."""
    idem = Idempotency(cluster_store, POLICY)
    for n in range(60):
        idem.run(Intent("busy-tenant", f"key-{n}", "fp"), lambda attempt: CREATED)

    keys = [cluster_store.layout.record_key("busy-tenant", f"key-{n}") for n in range(60)]
    per_node = collections.Counter(node_of(cluster_store, key) for key in keys)
    slots = {cluster_store.client.keyslot(key) for key in keys}

    assert len(per_node) == 3
    assert min(per_node.values()) >= 8  # 20 each on average
    assert len(slots) == 60
    assert all(cluster_store.client.exists(key) for key in keys)


def test_a_record_is_one_key_in_the_slot_of_its_hash_tag(cluster_store: RedisStore) -> None:
    """The hash tag alone picks the slot, so every script touches one slot only."""
    key = cluster_store.layout.record_key("alice", "k-1")
    tag = key[key.index(b"{") + 1 : key.index(b"}")]

    assert cluster_store.client.keyslot(key) == cluster_store.client.keyslot(b"{%s}" % tag)
    Idempotency(cluster_store, POLICY).run(Intent("alice", "k-1", "fp"), lambda a: CREATED)
    tagged = list(cluster_store.client.scan_iter(match=f"{cluster_store.layout.prefix}:*"))
    assert tagged == [key]


@pytest.mark.slow
def test_fifty_threads_race_for_each_key_on_the_cluster(
    cluster_store: RedisStore, table_name: str
) -> None:
    """60 threads claim one key at once, five keys (on different masters): one execution each."""
    for counts in race_threads(cluster_store, table_name, rounds=5, claimants=60):
        assert_exactly_once(counts, 60)


@pytest.mark.slow
def test_four_processes_race_for_each_key_on_the_cluster(
    cluster_store: RedisStore, table_name: str
) -> None:
    """4 processes × 15 threads on the cluster client, three keys: one execution per key."""
    totals = race_processes(
        ("redis-cluster", (table_name, started().url)),
        table_name,
        processes=4,
        rounds=3,
        claimants_per_process=15,
    )
    for counts in totals.values():
        assert_exactly_once(counts, 60)


@pytest.mark.slow
def test_a_dead_master_is_a_503_for_its_slots() -> None:
    """Kill the master that owns a key (no replica to fail over to): 503, never a run."""
    try:
        cluster = RedisClusterProcess.start()
    except (ClusterUnavailable, OSError) as exc:
        unreachable("Redis Cluster", exc)
    with cluster:
        store = RedisStore(redis_client(cluster.url, cluster=True), policy=POLICY, prefix="dead")
        idem = Idempotency(store, POLICY)
        key = store.layout.record_key("alice", "k-1")
        owner = store.client.get_node_from_key(key).port
        cluster.processes[cluster.ports.index(owner)].kill()
        handler = Recorder()

        with pytest.raises(StoreUnavailable) as raised:
            idem.run(Intent("alice", "k-1", "fp"), handler)
        store.client.close()
    assert raised.value.status == 503
    assert handler.calls == []


@pytest.mark.anyio
async def test_async_store_on_the_async_cluster_client(table_name: str) -> None:
    """AsyncRedisStore on redis.asyncio's RedisCluster: one execution, then replays, per key."""
    from idemflow import AsyncAttempt, AsyncIdempotency
    from idemflow.stores.redis import AsyncRedisStore, open_redis

    url = started().url.replace("redis://", "redis+cluster://")
    store = open_redis(url, policy=POLICY, prefix=table_name, asynchronous=True)
    assert isinstance(store, AsyncRedisStore)
    idem = AsyncIdempotency(store, POLICY)
    calls: list[str] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        calls.append(attempt.record.key)
        return CREATED

    try:
        first = [await idem.run(Intent("alice", f"k-{n}", "fp"), handler) for n in range(12)]
        again = [await idem.run(Intent("alice", f"k-{n}", "fp"), handler) for n in range(12)]
    finally:
        async for key in store.client.scan_iter(match=f"{table_name}:*"):
            await store.client.delete(key)
        await store.close()
    assert [o.replayed for o in first + again] == [False] * 12 + [True] * 12
    assert len(calls) == 12
