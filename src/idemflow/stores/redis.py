"""
Redis and Redis Cluster: key records as hashes, every decision in one Lua script.

The claim is the seed's ``SET key value NX PX <lease>``, generalised to the
record's whole life. ``SET NX PX`` says "create the key if it is absent, and
let it vanish after the lease". The claim script says the same: if the record
is absent (or past its retention, or its lease ran out) it writes a fresh
``in_progress`` record and ``PEXPIRE``\\ s it after the lease, exactly what
``SET NX PX`` would do. It adds the one case ``SET NX`` cannot express, the
retry of a *released* record by the same request (taken over, keeping its
recovery point), and it returns the existing record when the key is held, so
a replay is one round trip. Redis runs a script atomically, so the test and
the write have no window between them, as with ``SET NX``.

The lease (how long an ``in_progress`` record lives) is the policy's stale
threshold, derived from the request timeout. A crashed claim therefore
vanishes by itself: the sweeper is free. Completion, release and checkpoint
are compare-and-swap scripts on the lease token; a settled record gets its
own TTL, the rest of the retention period.

What this store cannot do is share a transaction with your business write
(``supports_transactions = False``: passing a transaction is refused before
anything runs). The claim may commit while your database rolls back, and a
completion may be lost after your effect committed. Send
``attempt.downstream_key(step)`` with every external call and reconcile:
see ``docs/stores.md``.

Cluster: a record is one key, and its hash tag (``{…}``) is a digest of
``(principal, key)``, so records spread evenly over the slots and every script
touches exactly one key, in one slot. The same class works on ``redis.Redis``
and ``redis.cluster.RedisCluster``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError, LeaseLost, StoreUnavailable
from .._model import (
    Claim,
    Intent,
    Policy,
    Record,
    Response,
    State,
    headers_from_json,
    headers_to_json,
)
from .protocol import AsyncTransaction, Transaction

__all__ = ["AsyncRedisStore", "RedisStore", "open_redis"]

DEFAULT_PREFIX = "idemflow"

# Clients made from a URL give up fast: a request waits at most about
# connect timeout × (retries + 1) before its 503, and every script is safe to
# retry (a retried write finds its own result and reports it again).
SOCKET_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
RETRIES = 2

# KEYS[1]: the record. ARGV: now, expires_at, lease_until, ttl, lease_token,
# principal, key, fingerprint, endpoint, correlation_id, has_correlation_id.
# Returns {'new'} when a fresh record was written, else {'taken' | 'held',
# field, value, …}: taken over by us (or our own claim, retried by the
# client after a lost reply), or held by someone else.
CLAIM = """
local k = KEYS[1]
local now = tonumber(ARGV[1])
local cur = redis.call('HMGET', k,
  'state', 'fingerprint', 'expires_at', 'lease_until', 'lease_token')
local state = cur[1]
local taken = false
if state then
  if state == 'in_progress' and cur[5] == ARGV[5] then
    return {'taken', unpack(redis.call('HGETALL', k))}
  end
  local gone = tonumber(cur[3]) <= now or (state == 'in_progress' and tonumber(cur[4]) <= now)
  if not gone then
    if state ~= 'released' or cur[2] ~= ARGV[8] then
      return {'held', unpack(redis.call('HGETALL', k))}
    end
    taken = true
  end
end
if taken then
  redis.call('HDEL', k, 'response_status', 'response_headers', 'response_body', 'correlation_id')
  redis.call('HINCRBY', k, 'attempt', 1)
else
  redis.call('DEL', k)
  redis.call('HSET', k, 'id', ARGV[5], 'principal', ARGV[6], 'key', ARGV[7],
    'created_at', ARGV[1], 'attempt', 1)
end
redis.call('HSET', k, 'state', 'in_progress', 'lease_token', ARGV[5], 'fingerprint', ARGV[8],
  'endpoint', ARGV[9], 'updated_at', ARGV[1], 'expires_at', ARGV[2], 'lease_until', ARGV[3])
if ARGV[11] == '1' then redis.call('HSET', k, 'correlation_id', ARGV[10]) end
redis.call('PEXPIRE', k, ARGV[4])
if taken then return {'taken', unpack(redis.call('HGETALL', k))} end
return {'new'}
"""

# The fence every owner write shares: our record (id, lease token), still in
# progress, neither past its lease nor its retention. ARGV[1..3]: id,
# lease_token, now. A write the client retries after a lost reply finds its
# own result already there (``done``) and reports success again.
_FENCE = """
local k = KEYS[1]
local now = tonumber(ARGV[3])
local cur = redis.call('HMGET', k, 'id', 'lease_token', 'state', 'expires_at', 'lease_until')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
if cur[3] == done then return 1 end
if cur[3] ~= 'in_progress' or tonumber(cur[4]) <= now or tonumber(cur[5]) <= now then
  return 0
end
"""

# ARGV[4..8]: state, status, headers, body, ttl (the rest of the retention).
COMPLETE = (
    "local done = ARGV[4]"
    + _FENCE
    + """
redis.call('HSET', k, 'state', ARGV[4], 'response_status', ARGV[5],
  'response_headers', ARGV[6], 'response_body', ARGV[7], 'updated_at', ARGV[3])
redis.call('HDEL', k, 'lease_until')
redis.call('PEXPIRE', k, ARGV[8])
return 1
"""
)

# ARGV[4]: ttl (the rest of the retention: a released record waits for its retry).
RELEASE = (
    "local done = 'released'"
    + _FENCE
    + """
redis.call('HSET', k, 'state', 'released', 'updated_at', ARGV[3])
redis.call('HDEL', k, 'lease_until')
redis.call('PEXPIRE', k, ARGV[4])
return 1
"""
)

# ARGV[4..6]: recovery_point, lease_until, ttl (a checkpoint renews the lease).
CHECKPOINT = (
    "local done = nil"
    + _FENCE
    + """
redis.call('HSET', k, 'recovery_point', ARGV[4], 'updated_at', ARGV[3], 'lease_until', ARGV[5])
redis.call('PEXPIRE', k, ARGV[6])
return 1
"""
)

SCRIPTS = {"claim": CLAIM, "complete": COMPLETE, "release": RELEASE, "checkpoint": CHECKPOINT}
#: What ``EVALSHA`` names each script by (the SHA-1 of its text).
SHAS = {name: hashlib.sha1(lua.encode()).hexdigest() for name, lua in SCRIPTS.items()}


def is_unavailable(exc: BaseException) -> bool:
    """Cannot reach Redis, or the cluster is moving a slot or electing a master."""
    from redis import exceptions as e

    return isinstance(
        exc,
        e.ConnectionError
        | e.TimeoutError
        | e.ClusterDownError
        | e.ClusterError
        | e.TryAgainError
        | e.MasterDownError
        | e.ReadOnlyError
        | e.SlotNotCoveredError
        | e.RedisClusterException
        | TimeoutError,
    )


@contextmanager
def _translate() -> Iterator[None]:
    """Redis failures become StoreUnavailable (503): fail closed, never run twice."""
    try:
        yield
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        raise StoreUnavailable(f"redis key store unavailable: {exc}".strip()) from exc


@dataclass(frozen=True, slots=True)
class Layout:
    """Where records live and how the scripts' arguments are spelled (no I/O).

    Args:
        prefix: the start of every key (one per application or test).
        lease_ms: how long an ``in_progress`` record lives without a checkpoint.
    """

    prefix: str
    lease_ms: int

    def record_key(self, principal: str, key: str) -> bytes:
        """``prefix:{tag}:len:principal:key``; the tag (a digest of both) picks the slot.

        Length-prefixed so no two (principal, key) pairs share a name; the
        digest spreads them over all 16384 slots instead of putting one
        principal's keys on one node.
        """
        who, what = principal.encode(), key.encode()
        name = b"%d:%s:%s" % (len(who), who, what)
        tag = hashlib.blake2b(name, digest_size=8).hexdigest().encode()
        return b"%s:{%s}:%s" % (self.prefix.encode(), tag, name)

    def claim_args(
        self, intent: Intent, lease_token: str, now: float, expires_at: float
    ) -> list[Any]:
        now_ms, expires_ms = _ms(now), _ms(expires_at)
        return [
            now_ms,
            expires_ms,
            now_ms + self.lease_ms,
            _ttl(min(self.lease_ms, expires_ms - now_ms)),
            lease_token,
            intent.principal,
            intent.key,
            intent.fingerprint,
            intent.endpoint,
            intent.correlation_id or "",
            "0" if intent.correlation_id is None else "1",
        ]

    def claimed(
        self, reply: Sequence[Any], intent: Intent, lease_token: str, now: float, expires_at: float
    ) -> Claim:
        verdict = _text(reply[0])
        if verdict == "new":
            record = Record(
                id=lease_token,
                principal=intent.principal,
                key=intent.key,
                fingerprint=intent.fingerprint,
                endpoint=intent.endpoint,
                state=State.IN_PROGRESS,
                lease_token=lease_token,
                created_at=_ms(now) / 1000,
                updated_at=_ms(now) / 1000,
                expires_at=_ms(expires_at) / 1000,
                correlation_id=intent.correlation_id,
            )
            return Claim(owned=True, record=record)
        return Claim(owned=verdict == "taken", record=record_from_hash(reply[1:]))

    def owner_args(self, record: Record, now: float) -> list[Any]:
        return [str(record.id), record.lease_token or "", _ms(now)]

    def complete_args(
        self, record: Record, state: State, response: Response, now: float
    ) -> list[Any]:
        return [
            *self.owner_args(record, now),
            state.value,
            response.status,
            headers_to_json(response.headers),
            response.body,
            _ttl(_ms(record.expires_at) - _ms(now)),
        ]

    def release_args(self, record: Record, now: float) -> list[Any]:
        return [*self.owner_args(record, now), _ttl(_ms(record.expires_at) - _ms(now))]

    def checkpoint_args(self, record: Record, recovery_point: str, now: float) -> list[Any]:
        now_ms = _ms(now)
        return [
            *self.owner_args(record, now),
            recovery_point,
            now_ms + self.lease_ms,
            _ttl(min(self.lease_ms, _ms(record.expires_at) - now_ms)),
        ]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _ttl(ms: int) -> int:
    """PEXPIRE with 0 or less deletes at once; a record past its time is gone anyway."""
    return max(1, ms)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def record_from_hash(flat: Sequence[bytes]) -> Record:
    """A record from ``HGETALL``'s flat ``field, value, …`` reply (bytes; times in ms).

    On the replay path, so written for speed: one dict, no per-field helpers.
    """
    pairs = iter(flat)
    fields: dict[bytes, bytes] = dict(zip(pairs, pairs, strict=True))
    get = fields.get
    status = get(b"response_status")
    response = None
    if status is not None:
        body = get(b"response_body") or b""
        response = Response(int(status), body, headers_from_json(get(b"response_headers")))
    return Record(
        id=fields[b"id"].decode(),
        principal=fields[b"principal"].decode(),
        key=fields[b"key"].decode(),
        fingerprint=fields[b"fingerprint"].decode(),
        endpoint=fields[b"endpoint"].decode(),
        state=State(fields[b"state"].decode()),
        lease_token=_optional(get(b"lease_token")),
        created_at=int(fields[b"created_at"]) / 1000,
        updated_at=int(fields[b"updated_at"]) / 1000,
        expires_at=int(fields[b"expires_at"]) / 1000,
        correlation_id=_optional(get(b"correlation_id")),
        recovery_point=_optional(get(b"recovery_point")),
        response=response,
        attempt=int(get(b"attempt") or 1),
    )


def _optional(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _layout(client: Any, policy: Policy | None, prefix: str) -> Layout:
    """Check the client can carry bytes, and derive the lease from the policy."""
    if client.get_encoder().decode_responses:
        msg = (
            "the Redis client must not decode responses (decode_responses=False): "
            "stored bodies are bytes"
        )
        raise ConfigurationError(msg)
    lease = (policy or Policy()).stale_seconds
    return Layout(prefix, int(lease * 1000))


class RedisStore:
    """Key records in Redis or Redis Cluster (``redis.Redis`` / ``redis.cluster.RedisCluster``).

    Args:
        client: a redis-py client with ``decode_responses=False``. Bound its
            retries (``retry=Retry(…, retries=2)``, ``socket_timeout``): an
            outage is answered 503 only once they are spent. Every script is
            safe to retry.
        policy: the :class:`~idemflow.Policy` you give ``Idempotency``. The
            store cannot see it otherwise, and takes from it the lease, the
            life of an ``in_progress`` record: ``policy.stale_after``
            (``2 × request_timeout + 10 s`` by default). A shorter lease would
            let a live claim vanish and its request run twice.
        prefix: the start of every key this store writes.

    ``supports_transactions`` is False: ``Idempotency.run(…, transaction=…)``
    raises ``ConfigurationError`` before claiming anything.
    """

    supports_transactions = False

    def __init__(
        self, client: Any, *, policy: Policy | None = None, prefix: str = DEFAULT_PREFIX
    ) -> None:
        from redis.exceptions import NoScriptError

        self.client = client
        self.layout = _layout(client, policy, prefix)
        self._no_script = NoScriptError

    def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> Claim:
        _refuse(transaction)
        args = self.layout.claim_args(intent, lease_token, now, expires_at)
        with _translate():
            reply = self._evalsha("claim", self._key(intent), args)
        return self.layout.claimed(reply, intent, lease_token, now, expires_at)

    def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        transaction: Transaction | None = None,
    ) -> None:
        _refuse(transaction)
        args = self.layout.complete_args(record, state, response, now)
        if not self._fenced("complete", record, args):
            raise LeaseLost(
                "the claim on this Idempotency-Key was taken over or expired before completion"
            )

    def release(self, record: Record, now: float) -> bool:
        return self._fenced("release", record, self.layout.release_args(record, now))

    def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: Transaction | None = None,
    ) -> None:
        _refuse(transaction)
        args = self.layout.checkpoint_args(record, recovery_point, now)
        if not self._fenced("checkpoint", record, args):
            raise LeaseLost("the claim on this Idempotency-Key was taken over or expired")

    def get(self, principal: str, key: str) -> Record | None:
        with _translate():
            flat = self.client.hgetall(self.layout.record_key(principal, key))
        return _from_reply(flat)

    def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Nothing to mark: an ``in_progress`` record vanishes when its lease ends."""
        return []

    def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        transaction: Transaction | None = None,
    ) -> bool:
        """False: this store never marks a record stale."""
        return False

    def release_stale(self, record: Record, now: float) -> bool:
        """False: this store never marks a record stale."""
        return False

    def purge(self, now: float, limit: int) -> int:
        """0: every record carries its own TTL, and Redis deletes it at the end."""
        return 0

    def migrate(self) -> None:
        """Nothing to create; loads the scripts (on every master of a cluster)."""
        with _translate():
            for lua in SCRIPTS.values():
                self.client.script_load(lua)

    def close(self) -> None:
        self.client.close()

    def _fenced(self, script: str, record: Record, args: list[Any]) -> bool:
        with _translate():
            return bool(self._evalsha(script, self._record_key(record), args))

    def _evalsha(self, script: str, key: bytes, args: list[Any]) -> Any:
        """One round trip; a server that lost its script cache is sent the text once."""
        try:
            return self.client.evalsha(SHAS[script], 1, key, *args)
        except self._no_script:
            self.client.script_load(SCRIPTS[script])
            return self.client.evalsha(SHAS[script], 1, key, *args)

    def _key(self, intent: Intent) -> bytes:
        return self.layout.record_key(intent.principal, intent.key)

    def _record_key(self, record: Record) -> bytes:
        return self.layout.record_key(record.principal, record.key)


class AsyncRedisStore:
    """:class:`RedisStore` for asyncio code, on ``redis.asyncio.Redis`` (or its cluster client)."""

    supports_transactions = False

    def __init__(
        self, client: Any, *, policy: Policy | None = None, prefix: str = DEFAULT_PREFIX
    ) -> None:
        from redis.exceptions import NoScriptError

        self.client = client
        self.layout = _layout(client, policy, prefix)
        self._no_script = NoScriptError

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim:
        _refuse(transaction)
        args = self.layout.claim_args(intent, lease_token, now, expires_at)
        key = self.layout.record_key(intent.principal, intent.key)
        with _translate():
            reply = await self._evalsha("claim", key, args)
        return self.layout.claimed(reply, intent, lease_token, now, expires_at)

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        _refuse(transaction)
        args = self.layout.complete_args(record, state, response, now)
        if not await self._fenced("complete", record, args):
            raise LeaseLost(
                "the claim on this Idempotency-Key was taken over or expired before completion"
            )

    async def release(self, record: Record, now: float) -> bool:
        return await self._fenced("release", record, self.layout.release_args(record, now))

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        _refuse(transaction)
        args = self.layout.checkpoint_args(record, recovery_point, now)
        if not await self._fenced("checkpoint", record, args):
            raise LeaseLost("the claim on this Idempotency-Key was taken over or expired")

    async def get(self, principal: str, key: str) -> Record | None:
        with _translate():
            flat = await self.client.hgetall(self.layout.record_key(principal, key))
        return _from_reply(flat)

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Nothing to mark: an ``in_progress`` record vanishes when its lease ends."""
        return []

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        """False: this store never marks a record stale."""
        return False

    async def release_stale(self, record: Record, now: float) -> bool:
        """False: this store never marks a record stale."""
        return False

    async def purge(self, now: float, limit: int) -> int:
        """0: every record carries its own TTL, and Redis deletes it at the end."""
        return 0

    async def migrate(self) -> None:
        """Nothing to create; loads the scripts (on every master of a cluster)."""
        with _translate():
            for lua in SCRIPTS.values():
                await self.client.script_load(lua)

    async def close(self) -> None:
        await self.client.aclose()

    async def _fenced(self, script: str, record: Record, args: list[Any]) -> bool:
        key = self.layout.record_key(record.principal, record.key)
        with _translate():
            return bool(await self._evalsha(script, key, args))

    async def _evalsha(self, script: str, key: bytes, args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(SHAS[script], 1, key, *args)
        except self._no_script:
            await self.client.script_load(SCRIPTS[script])
            return await self.client.evalsha(SHAS[script], 1, key, *args)


def open_redis(
    url: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    policy: Policy | None = None,
    asynchronous: bool = False,
) -> RedisStore | AsyncRedisStore:
    """A store on a client made from ``url``; ``redis+cluster://`` means a Redis Cluster."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    cluster = url.lower().startswith("redis+cluster://")
    if cluster:
        url = "redis://" + url.split("://", 1)[1]
    options: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
    }
    if asynchronous:
        from redis.asyncio import Redis as AsyncRedis
        from redis.asyncio.cluster import RedisCluster as AsyncCluster

        aclient: Any = (AsyncCluster if cluster else AsyncRedis).from_url(url, **options)
        return AsyncRedisStore(aclient, policy=policy, prefix=prefix)
    from redis import Redis
    from redis.cluster import RedisCluster

    client: Any = (RedisCluster if cluster else Redis).from_url(url, **options)
    return RedisStore(client, policy=policy, prefix=prefix)


def _from_reply(flat: Any) -> Record | None:
    """HGETALL answers a list (RESP2 raw) or a dict (parsed); empty when absent."""
    if not flat:
        return None
    if isinstance(flat, dict):
        flat = [item for pair in flat.items() for item in pair]
    return record_from_hash(flat)


def _refuse(transaction: object) -> None:
    """The driver refuses first; a direct caller is told the same."""
    if transaction is not None:
        msg = "the Redis store cannot share the caller's transaction"
        raise ConfigurationError(msg)
