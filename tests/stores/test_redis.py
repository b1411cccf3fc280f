"""
The Redis store beyond the shared contract: what only a Redis store has to show.

A claim never expires by itself: a crashed one stays ``in_progress`` (with
its recovery point) until the sweeper marks it stale, fenced against its old
owner and against other sweepers. Settled records keep their own TTL and an
entry in their bucket's expiry index; every index entry matches its record
after any mix of writes. A replay is one round trip, the store refuses the
caller's transaction at configuration time, and an unreachable or vanishing
server is a 503, never a second execution.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    ConfigurationError,
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Outcome,
    Policy,
    Record,
    Response,
    State,
    StoreUnavailable,
)
from idemflow._model import DEFAULT_STALE_SECONDS
from idemflow.cli import main
from idemflow.sweeper import (
    Answer,
    AsyncSweeper,
    DidNotHappen,
    Happened,
    Reconciler,
    Sweeper,
    SweepReport,
    Unknown,
)
from idemflow.testing import FrozenClock
from tests._private_redis import freeze, own_redis_server, thaw
from tests.backends import REDIS_URL, adelete_keys, delete_keys, redis_client
from tests.conftest import unreachable
from tests.factories import CREATED, POLICY, free_port
from tests.factories import uncorrelated_intent as intent
from tests.stores._race import Recorder, assert_exactly_once, race_processes, race_threads

redis = pytest.importorskip("redis")
from redis.connection import Connection  # noqa: E402

from idemflow.stores.redis import AsyncRedisStore, RedisStore, open_redis  # noqa: E402
from idemflow.stores.redis._scripts import (  # noqa: E402
    EXPIRES,
    IN_PROGRESS,
    RELEASED,
    STALE,
    record_from_hash,
)

pytestmark = pytest.mark.redis

THRESHOLD = POLICY.stale_seconds


@pytest.fixture
def store(table_name: str) -> Iterator[RedisStore]:
    client = redis_client()
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        unreachable("Redis", exc)
    # A frozen clock moves in these tests; the shared Redis keeps nothing on disk.
    made = RedisStore(client, prefix=table_name, clock="caller", allow_volatile=True)
    yield made
    delete_keys(client, table_name)
    made.close()


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def assert_indexes_match_records(store: RedisStore) -> dict[str, int]:
    """Every index entry is its record's, with its record's score, and nothing is missing.

    in_progress / stale / released-with-a-recovery-point: in their sweep index
    by stale_at (their own deadline; a stale one's mark), no TTL, never purged.
    Settled, and released with nothing to reconcile: in the expiry index by
    expires_at, with a TTL. Returns the records per state (so a caller can check
    the workload did what it meant).
    """
    client, layout = store.client, store.layout
    want: dict[bytes, dict[bytes, int]] = collections.defaultdict(dict)
    states: collections.Counter[str] = collections.Counter()
    for key in client.scan_iter(match=layout.record_pattern(), count=1000):
        record = record_from_hash([x for pair in client.hgetall(key).items() for x in pair])
        assert key == layout.record_key(record.principal, record.key)
        indexes = layout.indexes(layout.bucket(record.principal, record.key))
        states[record.state.value] += 1
        ttl = client.pttl(key)
        kept = record.state is State.RELEASED and record.recovery_point is not None
        if record.state in (State.IN_PROGRESS, State.STALE):
            position = IN_PROGRESS if record.state is State.IN_PROGRESS else STALE
            assert record.stale_at is not None  # its deadline (stale: its mark)
            want[indexes[position]][key] = ms(record.stale_at)
            assert ttl == -1, f"{record.key} ({record.state}) must not expire by itself"
        elif kept:
            assert record.stale_at is not None
            want[indexes[RELEASED]][key] = ms(record.stale_at)
            assert ttl == -1, f"{record.key} (released with progress) must not expire"
        else:
            want[indexes[EXPIRES]][key] = ms(record.expires_at)
            assert ttl > 0, f"{record.key} ({record.state}) needs its retention as TTL"
    have: dict[bytes, dict[bytes, int]] = {}
    pattern = re.escape(layout.prefix) + r":\{\d+\}:i:"
    for name in client.scan_iter(match=f"{layout.prefix}:{{*}}:i:*", count=1000):
        assert re.match(pattern.encode(), name)
        have[name] = {m: int(s) for m, s in client.zrange(name, 0, -1, withscores=True)}
    assert have == dict(want)
    return dict(states)


def keys_in_one_bucket(store: RedisStore, count: int) -> list[str]:
    """``count`` keys of alice's whose records share one bucket (and so one slot)."""
    first = store.layout.bucket("alice", "same-0")
    found = ["same-0"]
    n = 0
    while len(found) < count:
        n += 1
        if store.layout.bucket("alice", f"same-{n}") == first:
            found.append(f"same-{n}")
    return found


# --- the record's life: nothing in flight expires, the sweeper ends it ---------------


def test_a_claim_never_expires_by_itself(store: RedisStore) -> None:
    """An in_progress record has no TTL, however long its request runs; it is indexed."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD)
    store.checkpoint(claim.record, "charged", clock())
    key = store.layout.record_key("alice", "k-1")

    assert claim.owned
    assert store.client.pttl(key) == -1
    clock.advance(10 * THRESHOLD)
    assert not store.claim(
        intent(), "lease-b", clock(), clock() + 3600, stale_after=THRESHOLD
    ).owned
    assert assert_indexes_match_records(store) == {"in_progress": 1}


def test_settled_record_keeps_its_own_ttl_for_the_retention(store: RedisStore) -> None:
    """Completion gives the record its retention, counted from settlement, as its TTL."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD)
    clock.advance(10)
    store.complete(claim.record, State.COMPLETED, CREATED, clock(), clock() + 3600)

    ttl_ms = store.client.pttl(store.layout.record_key("alice", "k-1"))
    assert 3_599_000 < ttl_ms <= 3_600_000
    assert assert_indexes_match_records(store) == {"completed": 1}


def test_released_record_waits_for_the_retry_of_the_same_request(store: RedisStore) -> None:
    """Released keeps the record: the same request takes it over, another one gets 422."""
    clock = FrozenClock()
    idem = Idempotency(store, POLICY, clock=clock)
    idem.run(intent(), lambda attempt: Response(503))
    record = store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.RELEASED
    assert store.client.pttl(store.layout.record_key("alice", "k-1")) > 0  # nothing to resolve

    with pytest.raises(KeyReused):
        idem.run(intent(fp="fp-other"), lambda attempt: CREATED)
    retry = idem.run(intent(), lambda attempt: CREATED)
    assert (retry.replayed, retry.record.attempt, retry.record.created_at) == (
        False,
        2,
        record.created_at,
    )


def test_a_crashed_claim_is_marked_stale_and_keeps_its_recovery_point(store: RedisStore) -> None:
    """Past the threshold (not before) the sweeper marks the crash; it is asked with its point."""
    clock = FrozenClock()
    crashed = store.claim(
        intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD
    ).record
    store.checkpoint(crashed, "charged", clock())
    clock.advance(THRESHOLD)  # at the threshold: still live
    assert Sweeper(store, POLICY, clock=clock).sweep_once() == SweepReport()
    handler = Recorder()
    with pytest.raises(InProgress):  # a retry is told to wait, it never runs a second time
        Idempotency(store, POLICY, clock=clock).run(intent(), handler)
    assert handler.calls == []
    clock.advance(0.001)
    asked: list[Record] = []

    def unsure(record: Record, downstream_keys: Mapping[str, str]) -> Unknown:
        asked.append(record)
        return Unknown("provider timed out")

    report = Sweeper(store, POLICY, reconciler=unsure, clock=clock).sweep_once()

    assert report == SweepReport(unknown=1, batches=1)
    assert [(r.state, r.recovery_point, r.lease_token != "lease-a") for r in asked] == [
        (State.STALE, "charged", True)
    ]
    assert assert_indexes_match_records(store) == {"stale": 1}
    clock.advance(THRESHOLD + 1)  # asked again once retry_unknown_after has passed
    done = Sweeper(store, POLICY, reconciler=lambda r, k: Happened(CREATED), clock=clock)
    assert done.sweep_once() == SweepReport(completed=1, retried=1, batches=1)
    replay = Idempotency(store, POLICY, clock=clock).run(intent(), handler)
    assert (replay.replayed, replay.response, handler.calls) == (True, CREATED, [])
    assert assert_indexes_match_records(store) == {"completed": 1}


def test_a_rolling_upgrade_s_earlier_writes_are_ended_by_their_own_write_never_before(
    store: RedisStore,
) -> None:
    """Records an earlier version writes beside this one: its claim has no deadline, its
    take-over leaves the last owner's (and indexes the record by its write). Each is ended
    the default threshold after that write, never at the deadline it left."""
    clock = FrozenClock()
    for key in ("claimed-by-earlier", "taken-over"):
        store.claim(intent(key=key), f"lease-{key}", clock(), clock() + 3600, stale_after=5)
    client = store.client
    written = ms(clock())
    fresh = store.layout.record_key("alice", "claimed-by-earlier")
    client.hdel(fresh, "stale_after", "stale_at")
    index, *_, taken = store.layout.keys("alice", "taken-over")
    client.hset(taken, mapping={"stale_at": written - 60_000, "stale_after": 70_000})
    for record in (fresh, taken):
        client.zadd(index, {record: written})  # the earlier version's score: its write

    def swept(after: float) -> list[str]:
        marked = store.sweep(State.IN_PROGRESS, clock() + after, clock(), clock() + 3600, 10)
        return sorted(record.key for record in marked)

    assert swept(20) == []
    assert swept(DEFAULT_STALE_SECONDS + 1) == ["claimed-by-earlier", "taken-over"]


def test_an_overrun_owner_cannot_write_after_the_sweeper_marked_it(store: RedisStore) -> None:
    """Marked stale, the record refuses its old owner; settled by the sweeper, still refuses.

    The owner's scripts treat "already in the state I write" as their own
    retried write: the sweeper's mark takes a token of its own so that a
    settlement it wrote never passes for the owner's.
    """
    clock = FrozenClock()
    old = store.claim(intent(), "lease-old", clock(), clock() + 3600, stale_after=THRESHOLD).record
    clock.advance(THRESHOLD + 1)
    unsure = Sweeper(store, POLICY, reconciler=lambda r, k: Unknown(), clock=clock)
    assert unsure.sweep_once().unknown == 1
    marked = store.get("alice", "k-1")

    with pytest.raises(LeaseLost):
        store.complete(old, State.COMPLETED, CREATED, clock(), clock() + 3600)
    assert store.release(old, clock()) is False
    with pytest.raises(LeaseLost):
        store.checkpoint(old, "late", clock())
    assert store.get("alice", "k-1") == marked

    clock.advance(THRESHOLD + 1)
    reconciled = Response.json(201, {"id": "from_provider"})
    happened = Sweeper(store, POLICY, reconciler=lambda r, k: Happened(reconciled), clock=clock)
    assert happened.sweep_once().completed == 1
    with pytest.raises(LeaseLost):  # the same state the sweeper wrote: not the owner's write
        store.complete(old, State.COMPLETED, CREATED, clock(), clock() + 3600)
    assert store.release(old, clock()) is False
    settled = store.get("alice", "k-1")
    assert settled is not None
    assert (settled.state, settled.response) == (State.COMPLETED, reconciled)


def test_two_sweepers_racing_resolve_each_stale_record_exactly_once(
    store: RedisStore, table_name: str
) -> None:
    """Two sweepers (own clients) on the same 300 crashes: each asked about once, none lost."""
    clock = FrozenClock()
    keys = [f"crash-{n}" for n in range(300)]
    for key in keys:
        claimed = store.claim(
            intent(key), f"lease-{key}", clock(), clock() + 3600, stale_after=THRESHOLD
        ).record
        store.checkpoint(claimed, "charged", clock())
    clock.advance(THRESHOLD + 1)
    asked: collections.Counter[str] = collections.Counter()
    by_sweeper: collections.Counter[str] = collections.Counter()
    started = {"a": threading.Event(), "b": threading.Event()}
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=30)
    reports: dict[str, SweepReport] = {}

    def reconciler(name: str, other: str) -> Reconciler:
        def reconcile(record: Record, downstream_keys: Mapping[str, str]) -> Happened:
            with lock:
                asked[record.key] += 1
                by_sweeper[name] += 1
            started[name].set()
            # Neither gets past its first record before the other has one: they overlap.
            assert started[other].wait(timeout=30)
            return Happened(Response(201, record.key.encode()))

        return reconcile

    def sweep(name: str, other: str) -> None:
        own = RedisStore(redis_client(), prefix=table_name, clock="caller", allow_volatile=True)
        sweeper = Sweeper(own, POLICY, reconciler=reconciler(name, other), clock=clock)
        barrier.wait()
        try:
            reports[name] = sweeper.sweep_once()
        finally:
            own.close()

    threads = [
        threading.Thread(target=sweep, args=("a", "b")),
        threading.Thread(target=sweep, args=("b", "a")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert set(asked) == set(keys)
    assert set(asked.values()) == {1}
    assert min(by_sweeper.values()) > 0
    assert sum(r.completed for r in reports.values()) == len(keys)
    assert sum(r.lost + r.unknown for r in reports.values()) == 0
    for key in keys:
        record = store.get("alice", key)
        assert record is not None
        assert (record.state, record.response) == (State.COMPLETED, Response(201, key.encode()))
    assert assert_indexes_match_records(store) == {"completed": len(keys)}


def test_indexes_match_the_records_after_a_mixed_workload(store: RedisStore) -> None:
    """Completions, releases, crashes, three kinds of answers, takeovers, expiry and purge."""
    clock = FrozenClock()
    idem = Idempotency(store, POLICY, clock=clock)

    def progressed_then_failed(attempt: Attempt) -> Response:
        attempt.checkpoint("payment_created")
        return Response(503)

    for n in range(10):
        idem.run(intent(f"done-{n}"), lambda attempt: CREATED)
    for n in range(3):
        idem.run(intent(f"declined-{n}"), lambda attempt: Response(402))
    for n in range(5):
        idem.run(intent(f"failed-{n}"), lambda attempt: Response(503))
        idem.run(intent(f"progressed-{n}"), progressed_then_failed)
    for n in range(6):
        crashed = store.claim(
            intent(f"crash-{n}"), f"lease-{n}", clock(), clock() + 3600, stale_after=THRESHOLD
        ).record
        if n % 2:
            store.checkpoint(crashed, "charged", clock())
    assert assert_indexes_match_records(store) == {
        "completed": 10,
        "failed_permanent": 3,
        "released": 10,
        "in_progress": 6,
    }

    clock.advance(THRESHOLD + 1)

    def answer(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        number = int(record.key.rsplit("-", 1)[1])
        if record.key.startswith("progressed-"):
            return DidNotHappen("never charged") if number < 3 else Unknown()
        return (Happened(CREATED), DidNotHappen(), Unknown())[number % 3]

    Sweeper(store, POLICY, reconciler=answer, clock=clock).sweep_once()
    states = assert_indexes_match_records(store)
    assert states["stale"] == 2 + 2  # crash-2, crash-5; progressed-3, progressed-4

    for n in range(5):  # retries: released takeovers, fresh or from their point
        idem.run(intent(f"failed-{n}"), lambda attempt: CREATED)
    idem.run(intent("crash-1"), lambda attempt: CREATED)
    assert_indexes_match_records(store)

    clock.advance(3601)  # past every retention
    for n in range(4):  # expired takeovers: new intents under old keys
        idem.run(intent(f"done-{n}", fp="fp-new"), lambda attempt: Response(503))
    assert_indexes_match_records(store)
    while store.purge(clock(), 4) == 4:
        assert_indexes_match_records(store)
    left = assert_indexes_match_records(store)
    assert left == {"stale": 4, "released": 4}  # in recovery, and the four new intents


def test_each_settling_write_purges_expired_records_of_its_bucket(store: RedisStore) -> None:
    """Without any purge job the expiry index stays bounded: a completion takes two out."""
    check_settling_write_purges_its_bucket(store)


def check_settling_write_purges_its_bucket(store: RedisStore) -> None:
    """Three records of one bucket expire; the next completion there deletes two of them."""
    clock = FrozenClock()
    old, new = keys_in_one_bucket(store, 4)[:3], keys_in_one_bucket(store, 4)[3]
    for key in old:
        record = store.claim(intent(key), "l", clock(), clock() + 10, stale_after=THRESHOLD).record
        store.complete(record, State.COMPLETED, CREATED, clock(), clock() + 10)
    clock.advance(11)

    record = store.claim(intent(new), "l", clock(), clock() + 3600, stale_after=THRESHOLD).record
    store.complete(record, State.COMPLETED, CREATED, clock(), clock() + 3600)

    assert sum(store.get("alice", key) is None for key in old) == 2
    assert assert_indexes_match_records(store) == {"completed": 2}
    assert store.purge(clock(), 10) == 1
    assert assert_indexes_match_records(store) == {"completed": 1}


def test_purge_drops_the_entries_of_records_their_ttl_deleted(store: RedisStore) -> None:
    """Redis deletes a settled record at the end of its TTL; purge then drops its entry."""
    clock = FrozenClock()
    record = store.claim(intent(), "l", clock(), clock() + 3600, stale_after=THRESHOLD).record
    store.complete(record, State.COMPLETED, CREATED, clock(), clock() + 0.05)
    key = store.layout.record_key("alice", "k-1")
    deadline = time.monotonic() + 10
    while store.client.exists(key):
        assert time.monotonic() < deadline, "the TTL never fired"
        time.sleep(0.01)
    expiry = store.layout.indexes(store.layout.bucket("alice", "k-1"))[EXPIRES]
    assert store.client.zcard(expiry) == 1

    assert store.purge(clock() + 1, 10) == 1
    assert store.client.zcard(expiry) == 0


def test_hosts_whose_clocks_run_ahead_decide_on_redis_time(table_name: str) -> None:
    """On Redis's clock, a sweeper and a claimer five minutes ahead neither sweep a live
    claim nor take over a settled key before its retention ends; on their own clocks they
    would (the same steps on a caller-clock store, for contrast)."""
    ahead = 300.0

    def run(clock: Any) -> tuple[SweepReport, bool]:
        client = redis_client()
        store = RedisStore(client, prefix=f"{table_name}-{clock}", clock=clock, allow_volatile=True)
        try:
            now = time.time()
            store.claim(intent("live"), "lease-live", now, now + 3600, stale_after=THRESHOLD)
            done = store.claim(
                intent("settled"), "lease-done", now, now + 3600, stale_after=THRESHOLD
            ).record
            store.complete(done, State.COMPLETED, CREATED, now, now + 60)  # a 60 s retention
            fast = Policy(request_timeout=60, retention=60)  # stale after 130 s
            swept = Sweeper(store, fast, clock=lambda: time.time() + ahead).sweep_once()
            later = time.time() + ahead
            taken = store.claim(
                intent("settled", fp="fp-other"), "l", later, later + 60, stale_after=THRESHOLD
            ).owned
            return swept, taken
        finally:
            delete_keys(client, f"{table_name}-{clock}")
            store.close()

    assert run("database") == (SweepReport(), False)
    assert run("caller") == (SweepReport(released=1, batches=1), True)


def test_a_fresh_claim_reports_the_times_it_wrote(table_name: str) -> None:
    """On Redis's clock the claim's record is the stored one: updated_at is Redis's now."""
    client = redis_client()
    store = RedisStore(client, prefix=table_name, allow_volatile=True)
    try:
        now = time.time() - 3600  # a caller clock an hour behind
        claim = store.claim(intent(), "lease-a", now, now + 60, stale_after=THRESHOLD)
        stored = store.get("alice", "k-1")
    finally:
        delete_keys(client, table_name)
        store.close()
    assert claim.record == stored
    assert abs(claim.record.updated_at - time.time()) < 60
    assert claim.record.expires_at - claim.record.updated_at == pytest.approx(60, abs=0.01)
    assert claim.record.created_at == int(now * 1000) / 1000  # the intent's identity, as sent


def test_checkpoint_counts_as_life(store: RedisStore) -> None:
    """The sweeper's threshold runs from the last checkpoint, not from the claim."""
    clock = FrozenClock()
    claim = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD)
    clock.advance(15)
    store.checkpoint(claim.record, "charged", clock())
    clock.advance(15)

    assert Sweeper(store, POLICY, clock=clock).sweep_once() == SweepReport()
    store.complete(claim.record, State.COMPLETED, CREATED, clock(), clock() + 3600)


def test_every_script_is_safe_to_retry(store: RedisStore) -> None:
    """A client that resends a script after a lost reply finds its own result, not a loss."""
    clock = FrozenClock()
    first = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD)
    again = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=THRESHOLD)
    assert (first.owned, again.owned) == (True, True)
    assert again.record.id == first.record.id

    store.complete(first.record, State.COMPLETED, CREATED, clock(), clock() + 3600)
    store.complete(first.record, State.COMPLETED, CREATED, clock(), clock() + 3600)

    other = store.claim(
        intent("k-2"), "lease-b", clock(), clock() + 3600, stale_after=THRESHOLD
    ).record
    assert store.release(other, clock()) is True
    assert store.release(other, clock()) is True
    assert_indexes_match_records(store)


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
        redis.Redis(connection_pool=pool),
        prefix=store.layout.prefix,
        clock="caller",
        allow_volatile=True,
    )
    counting.start()  # what an app does at start-up: the epochs, written once
    CountingConnection.sent.clear()

    outcome = Idempotency(counting, POLICY).run(intent(), lambda attempt: Response(500))

    assert (outcome.replayed, outcome.response) == (True, CREATED)
    assert CountingConnection.sent == [b"EVALSHA"]
    counting.close()


def test_a_claim_answers_a_held_record_in_one_reply_element(store: RedisStore) -> None:
    """The claim packs the record it lost to into one string: every field comes back as
    stored (a body holding the packing's newline, NUL, 's' and '?', absent fields absent),
    and the reply is one element however many fields the record has (each costs the client
    Python)."""
    idem = Idempotency(store, POLICY)
    body = b"-1:x:-\x00\xff\n=3s?\x00" * 3
    stored = Response(201, body, (("content-type", "application/json"), ("location", "/p/1")))
    idem.run(intent("packed"), lambda attempt: stored)
    keys = store.layout.claim_keys("alice", "packed")
    args = store.layout.claim_args(intent("packed"), "another-token", time.time(), time.time() + 60)
    reply = store.client.evalsha(store._shas["claim"], len(keys), *keys, *args)

    assert reply[:5] == b"held "  # one bulk string, not an array
    fields = store.client.hgetall(store.layout.record_key("alice", "packed"))
    held = store.claim(
        intent("packed"), "another-token", time.time(), time.time() + 60, stale_after=THRESHOLD
    ).record
    assert held == record_from_hash([item for pair in fields.items() for item in pair])
    assert held.response == stored
    assert (held.recovery_point, held.correlation_id) == (None, None)


def test_a_server_that_lost_its_scripts_gets_them_again(tmp_path: Path) -> None:
    """After SCRIPT FLUSH (or a restart) the first call reloads the script and still decides."""
    with own_redis_server(tmp_path) as (_, url):
        store = RedisStore(redis_client(url), prefix="flushed", clock="caller", allow_volatile=True)
        store.client.script_flush()
        clock = FrozenClock()

        first = store.claim(intent(), "lease-a", clock(), clock() + 60, stale_after=THRESHOLD)
        second = store.claim(intent(), "lease-b", clock(), clock() + 60, stale_after=THRESHOLD)
        clock.advance(THRESHOLD + 1)
        store.client.script_flush()
        marked = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 60, 10)
        store.close()
    assert (first.owned, second.owned) == (True, False)
    assert [r.state for r in marked] == [State.STALE]


def test_keys_are_case_and_space_exact(store: RedisStore) -> None:
    """'Key' and 'key', 'k' and 'k ' are four different intents."""
    idem = Idempotency(store, POLICY)
    bodies = [
        idem.run(intent(k), Recorder(Response(201, k.encode()))) for k in ("Key", "key", "k", "k ")
    ]

    assert [o.replayed for o in bodies] == [False] * 4
    assert {o.response.body for o in bodies} == {b"Key", b"key", b"k", b"k "}


# --- operations: the CLI's sweep, stats and purge --------------------------------------


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_idemflow_sweep_stats_and_purge_work_on_redis(
    store: RedisStore, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's commands run on a redis:// URL: the crash is swept, counted, purged."""
    now = time.time()
    store.claim(
        intent("crashed"), "lease-c", now - 100, now + 3600, stale_after=THRESHOLD
    )  # older than 70 s
    done = store.claim(intent("done"), "lease-d", now - 7200, now, stale_after=THRESHOLD).record
    store.complete(done, State.COMPLETED, CREATED, now - 7200, now - 3600)
    url, table = REDIS_URL, ("--table", table_name)

    before = cli_json(capsys, "stats", url, *table)
    swept = cli_json(capsys, "sweep", url, *table)
    after = cli_json(capsys, "stats", url, *table)
    purged = cli_json(capsys, "purge", url, *table)

    assert before["by_state"] | {"in_progress": 1} == before["by_state"]
    assert (before["by_state"]["completed"], before["in_progress_past_stale_threshold"]) == (1, 1)
    assert before["oldest_in_progress"]["key"] == "crashed"
    assert before["expired_unpurged"] == 1
    assert (swept["released"], swept["batches"]) == (1, 1)
    assert after["by_state"]["released"] == 1
    assert after["in_progress_past_request_timeout"] == 0
    assert purged["purged"] == 1
    assert store.get("alice", "done") is None
    assert assert_indexes_match_records(store) == {"released": 1}


def test_the_stuck_claims_gauge_reads_a_redis_store(store: RedisStore) -> None:
    """The gauge counts claims older than the request timeout, and swept unresolved ones."""
    from idemflow.metrics import PrometheusMetrics

    clock = FrozenClock()
    for key in ("a", "b", "c"):
        store.claim(intent(key), key, clock(), clock() + 3600, stale_after=THRESHOLD)
    clock.advance(THRESHOLD + 1)
    store.claim(intent("fresh"), "fresh", clock(), clock() + 3600, stale_after=THRESHOLD)
    store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 1)
    metrics = PrometheusMetrics()
    metrics.watch_stale_claims(store, POLICY.request_timeout, cache_seconds=0, clock=clock)

    def sample(state: str) -> float | None:
        name = "idemflow_stale_in_progress"
        value: float | None = metrics.registry.get_sample_value(name, {"state": state})
        return value

    assert (sample("in_progress"), sample("stale")) == (2.0, 1.0)


# --- configuration ---------------------------------------------------------------


def test_a_transaction_is_refused_before_anything_is_claimed(store: RedisStore) -> None:
    """No shared transaction: passing one is a ConfigurationError, and no key is claimed."""
    handler = Recorder()

    with pytest.raises(ConfigurationError, match="cannot share the caller's transaction"):
        Idempotency(store, POLICY).run(intent(), handler, transaction=object())  # type: ignore[arg-type]
    assert handler.calls == []
    assert store.get("alice", "k-1") is None
    with pytest.raises(ConfigurationError, match="cannot share a transaction_factory"):
        Sweeper(store, POLICY, transaction_factory=contextlib.nullcontext)  # type: ignore[arg-type]


def test_a_decoding_client_is_refused_at_construction() -> None:
    """Bodies are bytes: a client with decode_responses=True is a configuration error."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    with pytest.raises(ConfigurationError, match="decode_responses"):
        RedisStore(client, policy=POLICY)
    client.close()


def test_a_prefix_with_a_hash_tag_is_refused() -> None:
    """The prefix comes before the bucket's hash tag: a brace in it would pick the slot."""
    client = redis_client()
    with pytest.raises(ConfigurationError, match="braces"):
        RedisStore(client, prefix="app{1}")
    client.close()


# --- outages ------------------------------------------------------------------------


def test_unreachable_redis_is_store_unavailable() -> None:
    """Nothing listening on the port: 503, and the handler never runs."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = open_redis(url + "?allow_volatile=1", policy=POLICY)
    assert isinstance(store, RedisStore)
    handler = Recorder()

    with pytest.raises(StoreUnavailable) as raised:
        Idempotency(store, POLICY).run(intent(), handler)
    assert raised.value.status == 503
    assert handler.calls == []
    with pytest.raises(StoreUnavailable):
        store.sweep(State.IN_PROGRESS, 0, 0, 0, 10)


@pytest.mark.anyio
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_a_store_opened_from_a_url_reconnects_a_connection_the_server_closed(
    asynchronous: bool, tmp_path: Path
) -> None:
    """Redis closes the pooled connection (an idle-client ``timeout``, a restart, CLIENT
    KILL): the next request's script is sent again on a new one, as the client's retries
    say, and answers 201, not 503. (``open_redis`` gave redis.asyncio's client redis-py's
    sync Retry, which it calls once and never retries.)"""
    with own_redis_server(tmp_path) as (_, url):
        store = open_redis(url + "?allow_volatile=1", policy=POLICY, asynchronous=asynchronous)
        killer = redis_client(url)
        try:
            first = await run_on(store, intent("before"))
            assert killer.client_kill_filter(_type="normal", skipme=True) == 1
            second = await run_on(store, intent("after"))
        finally:
            killer.close()
            await close(store)
    assert (first.response.status, second.response.status) == (201, 201)


async def run_on(store: RedisStore | AsyncRedisStore, request: Intent) -> Outcome:
    """``request`` through the driver of ``store``'s kind, its handler answering 201."""
    if isinstance(store, AsyncRedisStore):

        async def handler(attempt: AsyncAttempt) -> Response:
            return CREATED

        return await AsyncIdempotency(store, POLICY).run(request, handler)
    return Idempotency(store, POLICY).run(request, lambda attempt: CREATED)


async def close(store: RedisStore | AsyncRedisStore) -> None:
    if isinstance(store, AsyncRedisStore):
        await store.close()
    else:
        store.close()


def test_redis_stopping_mid_request_is_a_503_not_a_second_execution(tmp_path: Path) -> None:
    """The server dies while the handler runs: the completion fails closed, nothing reruns."""
    with own_redis_server(tmp_path) as (process, url):
        store = RedisStore(redis_client(url), policy=POLICY, prefix="outage", allow_volatile=True)
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
    store = AsyncRedisStore(client, policy=POLICY, prefix=table_name, allow_volatile=True)
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
        await adelete_keys(client, table_name)
        await store.close()
    assert (first.replayed, replay.replayed, replay.response) == (False, True, CREATED)
    assert len(seen) == 1
    assert record is not None
    assert record.recovery_point == "halfway"


@pytest.mark.anyio
async def test_async_store_sweeps_resolves_and_purges(table_name: str) -> None:
    """AsyncSweeper on AsyncRedisStore: crashes marked once, settled or released, then purged."""
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await client.ping()
    except redis.exceptions.ConnectionError as exc:
        unreachable("Redis", exc)
    store = AsyncRedisStore(client, prefix=table_name, clock="caller", allow_volatile=True)
    clock = FrozenClock()

    async def answer(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        return Happened(CREATED) if record.key == "charged" else DidNotHappen()

    try:
        for key in ("charged", "never"):
            record = (
                await store.claim(intent(key), key, clock(), clock() + 3600, stale_after=THRESHOLD)
            ).record
            await store.checkpoint(record, "payment_created", clock())
        clock.advance(THRESHOLD + 1)
        report = await AsyncSweeper(store, POLICY, reconciler=answer, clock=clock).sweep_once()
        again = await AsyncSweeper(store, POLICY, reconciler=answer, clock=clock).sweep_once()
        charged, never = await store.get("alice", "charged"), await store.get("alice", "never")
        clock.advance(3601)
        purged = await store.purge(clock(), 10)
        gone = await store.get("alice", "charged")
        kept = await store.get("alice", "never")
    finally:
        await adelete_keys(client, table_name)
        await store.close()
    assert (report.completed, report.released, report.batches) == (1, 1, 1)
    assert again == SweepReport()
    assert charged is not None
    assert never is not None
    assert (charged.state, charged.response) == (State.COMPLETED, CREATED)
    assert (never.state, never.recovery_point) == (State.RELEASED, "payment_created")
    assert (purged, gone) == (1, None)
    assert kept is not None  # released past a recovery point: kept for its retry, never purged


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


def test_each_driver_lengthens_the_refusal_after_a_loss_to_its_own_stale_threshold(
    store: RedisStore, table_name: str
) -> None:
    """A store given no policy refuses claims after a data loss for the stale threshold of
    the drivers made on it, the longest of them: a driver whose requests may run 100 s
    (threshold 210 s) must not see its keys claimed again after ``Policy()``'s 70 s."""
    from redis.asyncio import Redis as AsyncRedis

    unset = store.quarantine
    Idempotency(store, Policy(request_timeout=100))
    Idempotency(store, Policy(request_timeout=1))  # a shorter threshold never shortens it
    given = RedisStore(store.client, prefix=table_name, policy=Policy(request_timeout=1))
    async_store = AsyncRedisStore(AsyncRedis(), prefix=table_name)
    AsyncIdempotency(async_store, Policy(request_timeout=1))

    assert (unset, store.quarantine) == (Policy().stale_seconds, 210)
    assert (given.quarantine, async_store.quarantine) == (12, 12)


@pytest.mark.anyio
async def test_an_async_write_the_socket_cannot_take_is_still_bounded(tmp_path: Path) -> None:
    """``open_redis``'s async client sets no timer for a command the socket takes whole; one
    it cannot (a frozen server whose buffers are full) is still bounded: each attempt times
    out, and the completion is a 503, never a hang (the outer wait only catches a hang)."""
    import asyncio

    with own_redis_server(tmp_path) as (process, url):
        store = open_redis(url + "?allow_volatile=1", policy=POLICY, asynchronous=True)
        assert isinstance(store, AsyncRedisStore)
        try:
            now = time.time()
            claim = await store.claim(intent("big"), "token", now, now + 60)
            freeze(process)
            huge = Response(201, b"x" * (64 << 20))  # past both sockets' largest buffers
            completing = store.complete(claim.record, State.COMPLETED, huge, now, now + 60)
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(completing, 60)
        finally:
            thaw(process)
            await store.close()


@pytest.mark.anyio
async def test_an_async_url_store_packs_its_scripts_as_redis_py_would(table_name: str) -> None:
    """``open_redis``'s async client packs the store's scripts (every argument bytes) in one
    join: the very bytes redis-py's packer makes, whatever their size; another command, or an
    argument not bytes, is packed by redis-py. A large binary body makes the round trip."""
    from redis.asyncio.connection import Connection

    store = open_redis(REDIS_URL, prefix=table_name, asynchronous=True, allow_volatile=True)
    assert isinstance(store, AsyncRedisStore)
    pool = store.client.connection_pool
    ours, theirs = pool.connection_class(**pool.connection_kwargs), Connection()
    body = b"\r\n$3\r\n*1\r\n" + bytes(range(256)) * 40  # past redis-py's 6,000-byte chunks
    for args in (
        ("EVALSHA", b"sha", b"1", b"key", body, memoryview(body), b""),
        ("EVALSHA", b"sha", 1, "key"),
        ("HSET", b"key", "field", 1),
    ):
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))
    try:
        now = time.time()
        claim = await store.claim(intent("big"), "token", now, now + 60)
        stored = Response(201, body, (("content-type", "application/octet-stream"),))
        await store.complete(claim.record, State.COMPLETED, stored, now, now + 60)
        replay = await store.claim(intent("big"), "another", now, now + 60)
        assert (replay.owned, replay.record.response) == (False, stored)
    finally:
        await adelete_keys(store.client, table_name)
        await store.close()
