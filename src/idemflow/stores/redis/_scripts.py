"""
The Redis store's rules, without I/O: where records and indexes live, the Lua
scripts that decide, how their arguments are spelled and their replies read.

The stores that send them are ``AsyncRedisStore`` in ``idemflow._async.redis``
and its generated sync twin; import both from :mod:`idemflow.stores.redis`,
whose docstring explains the design.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..._errors import ConfigurationError, StoreUnavailable
from ..._model import (
    Claim,
    Intent,
    Policy,
    Record,
    Response,
    State,
    headers_json,
    make_claim,
    make_record,
    make_response,
    stored_headers,
)
from ..protocol import StoreClock

DEFAULT_PREFIX = "idemflow"

#: How many buckets (hash tags, so slots) the records of one prefix spread over.
#: Fixed: a record's key name depends on it.
BUCKETS = 1024
#: Buckets probed per pipelined round trip when the sweeper or purge walks them.
PROBE_CHUNK = 128
#: Round trips a walk over the buckets may take when each meets a connection the
#: server closed while idle (see the store's ``_ask_each``).
WALK_ATTEMPTS = 3
#: The boot script's ARGV[2]: what it does with an epoch that is absent (see _BOOT).
KEEP_ABSENT, CREATE_ABSENT, ARM_ABSENT = "0", "1", "2"

#: A bucket's indexes, in the order every script gets them as KEYS[1..4].
IN_PROGRESS, STALE, RELEASED, EXPIRES = range(4)
INDEXES = ("in_progress", "stale", "released", "expires")
#: The index each state the sweeper marks from is found in.
SWEPT_FROM = {State.IN_PROGRESS: IN_PROGRESS, State.STALE: STALE, State.RELEASED: RELEASED}

#: A record's hash fields, in the order a claim's reply packs them (see record_from_packed).
RECORD_FIELDS = (
    "id",
    "principal",
    "key",
    "fingerprint",
    "endpoint",
    "state",
    "lease_token",
    "created_at",
    "updated_at",
    "expires_at",
    "correlation_id",
    "recovery_point",
    "response_status",
    "response_headers",
    "response_body",
    "attempt",
)

# Clients made from a URL send a call again after a connection error or a timeout
# (every script is safe to retry: a retried write finds its own result and reports
# it again), this many times.
RETRIES = 2


def attempt_timeout(policy: Policy) -> float:
    """Each attempt's connect and socket timeout, for a client made from a URL: the
    policy's store wait shared by the first attempt and its retries, so a hung server
    answers 503 within ``policy.store_wait_seconds`` (plus the backoffs, a tenth of an
    attempt at most), not (1 + RETRIES) × a fixed timeout."""
    return policy.store_wait_seconds / (1 + RETRIES)


def shorten_waits(client: Any, store_wait: float, *, cluster: bool) -> None:
    """Each attempt of ``client`` waits at most :func:`attempt_timeout`'s share of
    ``store_wait`` from now on, where it waited longer: in the settings new connections
    are made with, and on each connection held (redis.asyncio reads it at each call; a
    sync one's socket is told at once)."""
    from redis.cluster import RedisCluster

    attempt = store_wait / (1 + RETRIES)
    if not cluster:
        _shorten_pool(client.connection_pool, attempt)
        return
    _shorten(client.nodes_manager.connection_kwargs, [], attempt)
    for node in client.get_nodes():
        if isinstance(client, RedisCluster):  # sync: each node a client of its own
            if node.redis_connection is not None:
                _shorten_pool(node.redis_connection.connection_pool, attempt)
        else:  # redis.asyncio's nodes hold their connections themselves
            _shorten(node.connection_kwargs, node._connections, attempt)


def _shorten(settings: dict[str, Any], connections: Iterable[Any], attempt: float) -> bool:
    if (settings.get("socket_timeout") or math.inf) <= attempt:
        return False
    settings["socket_timeout"] = settings["socket_connect_timeout"] = attempt
    for conn in connections:
        conn.socket_timeout = conn.socket_connect_timeout = attempt
    return True


def _shorten_pool(pool: Any, attempt: float) -> None:
    from redis import ConnectionPool

    held = [*pool._available_connections, *pool._in_use_connections]
    if _shorten(pool.connection_kwargs, held, attempt) and isinstance(pool, ConnectionPool):
        for conn in held:
            _shorten_socket(conn, attempt)


def _shorten_socket(conn: Any, attempt: float) -> None:
    """A connected sync ``conn``'s socket, which keeps the timeout it was opened with, and
    its parser's copy (restored after each poll of the pool's checkout): as redis-py's own
    ``update_current_socket_timeout`` does (recent releases only). Never reconnects."""
    sock = conn._sock
    if sock is None:
        return
    sock.settimeout(attempt)
    parser = conn._parser
    if getattr(parser, "_buffer", None) is not None:  # the pure-Python parsers
        parser._buffer.socket_timeout = attempt
    if hasattr(parser, "_socket_timeout"):  # hiredis's
        parser._socket_timeout = attempt


# Every script starts on its clock: ``now`` (ms) is the time its decisions are
# taken on. On the store's clock (the default) that is Redis's own ``TIME``,
# one clock for every app server and sweeper, and each instant a caller
# computed on its own clock (an expiry, the sweeper's cutoff) keeps only its
# distance from the caller's now, ARGV[1]: ``at(instant)``. On the caller's
# clock (frozen-clock tests) ``now`` is ARGV[1] and ``at`` changes nothing.
# ``created_at`` is an identity (it names the intent's downstream keys), never
# compared: it stays the caller's ARGV[1]. Times are written as integer strings.
_ON_STORE_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
_ON_CALLER_CLOCK = """
local now = tonumber(ARGV[1])
"""
_CLOCK = """
local function at(instant) return now + (tonumber(instant) - tonumber(ARGV[1])) end
local function ms(number) return string.format('%d', number) end
local NOW = ms(now)
"""

# Every script but the probe: KEYS[1..4] the bucket's indexes, then the record(s).
_INDEXES = """
local IP, ST, REL, EXP = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
"""

# What the scripts that settle or delete records share (kept out of the claim's
# hot path: a script pays for the closures it defines on every call).
_RETENTION = """
-- A settled or released record is replayed (or retried) until it expires. With
-- nothing left to resolve it joins the expiry index and gets the rest of its
-- retention as its TTL; released past a recovery point, it is the sweeper's
-- (and its retry's) until resolved: no TTL, never purged.
local function retain(k, expires, progress)
  if progress then
    redis.call('ZADD', REL, NOW, k)
  else
    redis.call('ZADD', EXP, expires, k)
    redis.call('PEXPIRE', k, ms(math.max(1, tonumber(expires) - now)))
  end
end

-- Delete k if its retention ended (_model.is_past_retention): 1. An entry whose
-- record its TTL already deleted is dropped: 1. An entry that is not the
-- expiry index's is dropped, one with an old score corrected: 0.
local function purge_one(k)
  local cur = redis.call('HMGET', k, 'state', 'expires_at', 'recovery_point')
  local state = cur[1]
  local purgeable = state == 'completed' or state == 'failed_permanent'
    or (state == 'released' and not cur[3])
  if purgeable and tonumber(cur[2]) > now then
    redis.call('ZADD', EXP, cur[2], k)
    return 0
  end
  redis.call('ZREM', EXP, k)
  if not purgeable then
    if state then return 0 end
    return 1
  end
  redis.call('DEL', k)
  return 1
end

-- Each settling write adds one expiry entry and purges up to two past retention
-- (same bucket, so same slot): the index stays bounded without a purge job.
local function trim(own)
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', EXP, '-inf', NOW, 'LIMIT', 0, 2)) do
    if k ~= own then purge_one(k) end
  end
end
"""

# A record in one bulk string: each of RECORD_FIELDS in order, as '<length>:<value>',
# or '-' for a field the record does not have (record_from_packed reads it).
_PACKED = (
    "local FIELDS = {"
    + ", ".join(f"'{name}'" for name in RECORD_FIELDS)
    + """}
local function packed(k)
  local values = redis.call('HMGET', k, unpack(FIELDS))
  for i = 1, #FIELDS do
    local v = values[i]
    if v then values[i] = #v .. ':' .. v else values[i] = '-' end
  end
  return table.concat(values)
end
"""
)

# KEYS[5]: the record. ARGV: now, expires_at, lease_token, principal, key,
# fingerprint, endpoint, correlation_id, has_correlation_id. Returns {'new',
# 'updated_at expires_at'} when a fresh record was written, else {'taken' |
# 'held', the record packed (see _PACKED)}: taken over by us (or our own claim,
# retried after a lost reply), or held. Two reply elements whatever the record
# holds: a client parses each element of a reply in Python, and HGETALL's 32
# (a replay's whole record, field by field) cost a replay more than the rest
# of its round trip. The take-over rule is _model.can_take_over: the
# same request retrying a released record, or a record past its retention
# (settled, or released with nothing to reconcile); only the latter, when it
# is not a retry, starts a new intent. In flight (in_progress) or being
# recovered (stale) is never taken over, however old: only the sweeper ends it.
#
# KEYS[6]: the bucket's epoch, ARGV[10]: the quarantine (ms). The epoch holds
# "<armed_ms> <run_id>": when a loss was last found in the bucket (0: never)
# and the server boot (INFO's run_id) the bucket was last seen on, which the
# boot script (_BOOT) writes and compares; a claim reads only the first field.
# The store writes every bucket's epoch when it starts. An epoch that is gone
# means this bucket's data vanished since (a restart without persistence, a
# flush, an empty replica promoted); a boot that changed means the server
# restarted (or failed over) and may have lost its last writes (an AOF fsynced
# every second, RDB snapshots). Either way requests that claimed before may
# still be running, and their records may be gone. So every claim in the bucket
# that would write a record (a fresh key, a take-over) answers {'lost', ms left}
# until the quarantine (the stale threshold) has passed since the loss was found
# (a vanished epoch is written again with that time) or since the boot. The claim
# that finds a vanished epoch answers {'lost', ms left, 'found'}: the store then
# arms every other vanished epoch from then (the boot script, ARM_ABSENT), so the
# quarantine of every bucket the loss took ends a threshold after its discovery,
# not after each bucket's first claim. A claim that only reads (a replay, a
# request in flight: 409, a key reused: 422) still answers from the record.
# (Only the benchmark's raw calls leave KEYS[6] out.)
_CLAIM = (
    _PACKED
    + """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'state', 'fingerprint', 'expires_at', 'lease_token',
  'recovery_point')
local state = cur[1]
local retry = false
if state then
  if state == 'in_progress' and cur[4] == ARGV[3] then
    return {'taken', packed(K)}
  end
  retry = state == 'released' and cur[2] == ARGV[6]
  local past = tonumber(cur[3]) <= now and (state == 'completed' or state == 'failed_permanent'
    or (state == 'released' and not cur[5]))
  if not (retry or past) then
    return {'held', packed(K)}
  end
end
if KEYS[6] then
  local epoch = redis.call('GET', KEYS[6])
  local armed = now
  if epoch then
    armed = tonumber(string.match(epoch, '^%d+'))
  else
    redis.call('SET', KEYS[6], NOW)
  end
  local left = armed + tonumber(ARGV[10]) - now
  if left > 0 then
    if epoch then return {'lost', ms(left)} end
    return {'lost', ms(left), 'found'}
  end
end
if state then
  redis.call('ZREM', EXP, K)
  redis.call('ZREM', REL, K)
end
local expires = ms(at(ARGV[2]))
if retry then
  redis.call('HDEL', K, 'response_status', 'response_headers', 'response_body', 'correlation_id')
  redis.call('HINCRBY', K, 'attempt', 1)
  redis.call('PERSIST', K)
else
  if state then redis.call('DEL', K) end
  redis.call('HSET', K, 'id', ARGV[3], 'principal', ARGV[4], 'key', ARGV[5],
    'created_at', ARGV[1], 'attempt', 1)
end
redis.call('HSET', K, 'state', 'in_progress', 'lease_token', ARGV[3], 'fingerprint', ARGV[6],
  'endpoint', ARGV[7], 'updated_at', NOW, 'expires_at', expires)
if ARGV[9] == '1' then redis.call('HSET', K, 'correlation_id', ARGV[8]) end
redis.call('ZADD', IP, NOW, K)
if retry then return {'taken', packed(K)} end
return {'new', NOW .. ' ' .. expires}
"""
)

# The epochs in ``epochs`` (see BOOT_SCRIPTS for where they come from). ARGV[1]:
# now, ARGV[2]: what an absent epoch becomes: KEEP_ABSENT leaves it (a loss the
# next claim in its bucket finds), CREATE_ABSENT writes it unarmed (the store's
# start), ARM_ABSENT armed from now (a claim found a loss). Tells each epoch
# which server boot it is on: the script cache does not survive a restart, so
# every store runs this before it loads the scripts into a server (at its
# start, and whenever a script is missing), and no claim runs on a boot whose
# epochs were not told. An epoch last seen on another boot is armed from that
# boot (now - uptime, a second late at most), so the quarantine ends a stale
# threshold after the restart however late a bucket is found, and at once where
# the restart is older. An epoch that never saw a boot (written before this
# rule, or by a claim that found it gone) just learns it. Returns the run_id.
_BOOT = """
local info = redis.call('INFO', 'server')
local run = string.match(info, 'run_id:(%x+)')
local boot = now - 1000 * tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
for _, k in ipairs(epochs) do
  local epoch = redis.call('GET', k)
  if not epoch then
    if ARGV[2] == '1' then
      redis.call('SET', k, '0 ' .. run)
    elseif ARGV[2] == '2' then
      redis.call('SET', k, NOW .. ' ' .. run)
    end
  else
    local armed, seen = string.match(epoch, '^(%d+) ?(%x*)')
    if seen ~= run then
      if seen ~= '' then armed = ms(math.max(tonumber(armed), boot)) end
      redis.call('SET', k, armed .. ' ' .. run)
    end
  end
end
return run
"""

# The fence every owner write shares: our record (id, lease token), still in
# progress. ARGV[2..3]: id, lease_token. A write the client retries after a
# lost reply finds its own result already there (``done``) and reports success
# again; a record the sweeper marked carries the sweeper's token, never ours.
_FENCE = """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'id', 'lease_token', 'state', 'expires_at', 'recovery_point')
if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[3] then return 0 end
if cur[3] == done then return 1 end
if cur[3] ~= 'in_progress' then return 0 end
"""

# ARGV[4..8]: state, status, headers, body, expires_at (retention from now).
_COMPLETE = (
    "local done = ARGV[4]"
    + _FENCE
    + """
local expires = ms(at(ARGV[8]))
redis.call('HSET', K, 'state', ARGV[4], 'response_status', ARGV[5],
  'response_headers', ARGV[6], 'response_body', ARGV[7], 'updated_at', NOW,
  'expires_at', expires)
redis.call('ZREM', IP, K)
retain(K, expires, false)
trim(K)
return 1
"""
)

# The claim's expires_at bounds a released record.
_RELEASE = (
    "local done = 'released'"
    + _FENCE
    + """
redis.call('HSET', K, 'state', 'released', 'updated_at', NOW)
redis.call('ZREM', IP, K)
retain(K, cur[4], cur[5])
trim(K)
return 1
"""
)

# ARGV[4]: recovery_point. A checkpoint counts as life: updated_at moves on.
_CHECKPOINT = (
    "local done = nil"
    + _FENCE
    + """
redis.call('HSET', K, 'recovery_point', ARGV[4], 'updated_at', NOW)
redis.call('ZADD', IP, NOW, K)
return 1
"""
)

# KEYS[1]: one index of one bucket. ARGV: now, bound (an instant), limit, '1'
# if the bound is inclusive. What is due there, oldest first: the sweeper's
# and purge's look before they act (on each node's own clock in a cluster).
_PROBE = """
local bound = ms(at(ARGV[2]))
if ARGV[4] ~= '1' then bound = '(' .. bound end
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', bound, 'LIMIT', 0, tonumber(ARGV[3]))
"""

# KEYS[1]: one index of one bucket. ARGV: now, cutoff (an instant). The sweeper's
# schedule: the oldest entry's score minus the cutoff, in ms, on this node's
# clock (negative: due already), or nil for an empty index.
_DUE = """
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return false end
return ms(tonumber(first[2]) - at(ARGV[2]))
"""

# KEYS[5…]: records the probe listed as due. ARGV: now, from_state, cutoff,
# keep_until, sweep token. Each is re-checked (state, age) and marked only if
# still due, so of two sweepers each record goes to one; the mark takes a
# token of the sweeper's own, which fences the old owner out. Entries that no
# longer belong to the index are dropped. Returns the marked records.
_SWEEP = """
local from = ARGV[2]
local index = (from == 'in_progress' and IP) or (from == 'stale' and ST) or REL
local cutoff, keep = at(ARGV[3]), at(ARGV[4])
local marked = {}
for i = 5, #KEYS do
  local k = KEYS[i]
  local cur = redis.call('HMGET', k, 'state', 'updated_at', 'expires_at', 'recovery_point')
  if cur[1] ~= from or (from == 'released' and not cur[4]) then
    redis.call('ZREM', index, k)
  elseif tonumber(cur[2]) < cutoff then
    local expires = cur[3]
    if tonumber(expires) < keep then expires = ms(keep) end
    redis.call('HSET', k, 'state', 'stale', 'lease_token', ARGV[5], 'updated_at', NOW,
      'expires_at', expires)
    redis.call('ZREM', index, k)
    redis.call('ZADD', ST, NOW, k)
    marked[#marked + 1] = redis.call('HGETALL', k)
  end
end
return marked
"""

# The fence of a sweeper's write: the record exactly as this sweeper marked it
# (id, its token, stale, updated_at of the mark). ARGV[2..4]: id, token, marked_at.
_MARKED = """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'id', 'lease_token', 'state', 'updated_at', 'expires_at',
  'recovery_point')
if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[3] or cur[3] ~= 'stale' or cur[4] ~= ARGV[4] then
  return 0
end
redis.call('ZREM', ST, K)
"""

# ARGV[5..9]: state, status, headers, body, expires_at.
_SETTLE_STALE = (
    _MARKED
    + """
local expires = ms(at(ARGV[9]))
redis.call('HSET', K, 'state', ARGV[5], 'response_status', ARGV[6],
  'response_headers', ARGV[7], 'response_body', ARGV[8], 'updated_at', NOW,
  'expires_at', expires)
retain(K, expires, false)
trim(K)
return 1
"""
)

# ARGV[5]: '1' to forget the recovery point (the reconciler undid its traces).
_RELEASE_STALE = (
    _MARKED
    + """
local progress = cur[6]
if ARGV[5] == '1' then
  progress = false
  redis.call('HDEL', K, 'recovery_point')
end
redis.call('HSET', K, 'state', 'released', 'updated_at', NOW)
retain(K, cur[5], progress)
trim(K)
return 1
"""
)

# KEYS[5…]: records the probe listed as past retention. ARGV: now.
_PURGE = """
local purged = 0
for i = 5, #KEYS do purged = purged + purge_one(KEYS[i]) end
return purged
"""

#: Each script's body and what it needs before it: the record indexes, the retention helpers.
_BODIES = {
    "claim": (_INDEXES, _CLAIM),
    "complete": (_INDEXES + _RETENTION, _COMPLETE),
    "release": (_INDEXES + _RETENTION, _RELEASE),
    "checkpoint": (_INDEXES, _CHECKPOINT),
    "probe": ("", _PROBE),
    "due": ("", _DUE),
    "sweep": (_INDEXES, _SWEEP),
    "settle_stale": (_INDEXES + _RETENTION, _SETTLE_STALE),
    "release_stale": (_INDEXES + _RETENTION, _RELEASE_STALE),
    "purge": (_INDEXES + _RETENTION, _PURGE),
}


def scripts(clock: StoreClock = "database") -> dict[str, str]:
    """Every script's text, on Redis's clock (``database``) or the caller's."""
    start = _ON_STORE_CLOCK if clock == "database" else _ON_CALLER_CLOCK
    return {name: start + _CLOCK + head + body for name, (head, body) in _BODIES.items()}


def _shas(texts: dict[str, str]) -> dict[str, str]:
    return {name: hashlib.sha1(lua.encode()).hexdigest() for name, lua in texts.items()}


#: The scripts a store on Redis's clock (the default) runs, and the SHA-1s ``EVALSHA`` names.
SCRIPTS = scripts("database")
SHAS = _shas(SCRIPTS)
_CALLER_SCRIPTS = scripts("caller")
ON_CLOCK = {"database": (SCRIPTS, SHAS), "caller": (_CALLER_SCRIPTS, _shas(_CALLER_SCRIPTS))}
#: The boot script on each clock, sent with ``EVAL`` (rarely: at start, when a script is
#: missing), in two forms. ``"keys"``: the epochs are its KEYS, all of one server
#: (or one bucket's on a cluster, one slot). ``"node"``: the epochs are ARGV[3…],
#: every bucket one master of a cluster serves, KEYS[1] one of them to route it
#: there; ``allow-cross-slot-keys`` (Redis ≥ 7, Valkey) lets one script touch them,
#: so one ``INFO`` per master instead of one per bucket.
BOOT_SCRIPTS = {
    clock: {
        "keys": start + _CLOCK + "local epochs = KEYS\n" + _BOOT,
        "node": "#!lua flags=allow-cross-slot-keys\n"
        + start
        + _CLOCK
        + "local epochs = {unpack(ARGV, 3)}\n"
        + _BOOT,
    }
    for clock, start in (("database", _ON_STORE_CLOCK), ("caller", _ON_CALLER_CLOCK))
}


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


def is_connection_lost(exc: BaseException) -> bool:
    """A connection ended or refused, not a timeout: a read may be sent again on another.

    redis-py's cluster client reports one as ``RedisClusterUnreachableError`` (its
    cause the connection error) when its last topology refresh met one too."""
    from redis import exceptions as e

    if isinstance(exc, e.RedisClusterException):
        exc = exc.__cause__ or exc
    return isinstance(exc, e.ConnectionError)


def raise_unavailable(exc: Exception) -> None:
    """Raise the StoreUnavailable (503) a Redis failure means; return if it means none."""
    if is_unavailable(exc):
        raise StoreUnavailable(f"redis key store unavailable: {exc}".strip()) from exc


@contextmanager
def translated() -> Iterator[None]:
    """Redis failures become StoreUnavailable (503): fail closed, never run twice."""
    try:
        yield
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        raise StoreUnavailable(f"redis key store unavailable: {exc}".strip()) from exc


@dataclass(frozen=True, slots=True)
class Layout:
    """Where records and indexes live and how the scripts' arguments are spelled (no I/O).

    Args:
        prefix: the start of every key (one per application or test).
        buckets: how many hash tags the records spread over (see the module).
    """

    prefix: str
    buckets: int = BUCKETS
    _indexes: tuple[tuple[bytes, ...], ...] = field(init=False, repr=False, compare=False)
    _epochs: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _head: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if any(c in self.prefix for c in "{}"):
            msg = f"the Redis key prefix must not contain braces (hash tags): {self.prefix!r}"
            raise ConfigurationError(msg)
        head = self.prefix.encode()
        indexes = tuple(
            tuple(b"%s:{%d}:i:%s" % (head, bucket, name.encode()) for name in INDEXES)
            for bucket in range(self.buckets)
        )
        object.__setattr__(self, "_indexes", indexes)
        epochs = tuple(b"%s:{%d}:epoch" % (head, bucket) for bucket in range(self.buckets))
        object.__setattr__(self, "_epochs", epochs)
        object.__setattr__(self, "_head", head)

    def bucket(self, principal: str, key: str) -> int:
        return self._locate(principal, key)[0]

    def record_key(self, principal: str, key: str) -> bytes:
        """``prefix:{bucket}:k:len:principal:key``; the bucket (from a digest) picks the slot.

        Length-prefixed so no two (principal, key) pairs share a name; the
        digest spreads them over every bucket instead of putting one
        principal's keys in one.
        """
        return self._locate(principal, key)[1]

    def keys(self, principal: str, key: str) -> tuple[bytes, ...]:
        """What a record's scripts get as KEYS: its bucket's four indexes, then the record."""
        bucket, record = self._locate(principal, key)
        return (*self._indexes[bucket], record)

    def claim_keys(self, principal: str, key: str) -> tuple[bytes, ...]:
        """The claim's KEYS: those of :meth:`keys`, then the bucket's epoch."""
        bucket, record = self._locate(principal, key)
        return (*self._indexes[bucket], record, self._epochs[bucket])

    def epoch_key(self, bucket: int) -> bytes:
        """The bucket's epoch (same slot): its absence tells the claim that data was lost."""
        return self._epochs[bucket]

    def epoch_keys(self) -> list[bytes]:
        """Every bucket's epoch, in bucket order."""
        return list(self._epochs)

    def indexes(self, bucket: int) -> tuple[bytes, ...]:
        """A bucket's indexes: in_progress, stale, released, expires (all in one slot)."""
        return self._indexes[bucket]

    def record_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every record of this prefix (not the indexes)."""
        return _glob_escape(self.prefix) + ":{*}:k:*"

    def walk(self) -> Iterator[tuple[int, ...]]:
        """Every bucket once, in chunks of :data:`PROBE_CHUNK`, from a random one."""
        start = random.randrange(self.buckets)
        order = [(start + n) % self.buckets for n in range(self.buckets)]
        for at in range(0, self.buckets, PROBE_CHUNK):
            yield tuple(order[at : at + PROBE_CHUNK])

    def _locate(self, principal: str, key: str) -> tuple[int, bytes]:
        who, what = principal.encode(), key.encode()
        name = b"%d:%s:%s" % (len(who), who, what)
        digest = hashlib.blake2b(name, digest_size=8).digest()
        bucket = int.from_bytes(digest, "big") % self.buckets
        return bucket, b"%s:{%d}:k:%s" % (self._head, bucket, name)

    # --- script arguments (ARGV[1] is always now, in ms) ---------------------------

    def claim_args(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        quarantine: float = 0.0,
    ) -> list[Any]:
        return [
            ms(now),
            ms(expires_at),
            lease_token,
            intent.principal,
            intent.key,
            intent.fingerprint,
            intent.endpoint,
            intent.correlation_id or "",
            "0" if intent.correlation_id is None else "1",
            ms(quarantine),
        ]

    @staticmethod
    def found_loss(reply: Sequence[Any]) -> bool:
        """Whether this claim was the one that found its bucket's epoch gone (a loss)."""
        return len(reply) > 2

    def claimed(
        self, reply: Sequence[Any], intent: Intent, lease_token: str, now: float, expires_at: float
    ) -> Claim:
        verdict = text(reply[0])
        if verdict == "lost":
            raise data_lost(int(reply[1]) / 1000)
        if verdict == "new":  # the times the script wrote, on its clock: 'now expires'
            updated_at, _, expires = bytes(reply[1]).partition(b" ")
            record = make_record(
                lease_token,  # the id
                intent.principal,
                intent.key,
                intent.fingerprint,
                intent.endpoint,
                State.IN_PROGRESS,
                lease_token,
                ms(now) / 1000,  # created_at
                int(updated_at) / 1000,
                int(expires) / 1000,  # expires_at
                intent.correlation_id,
                None,  # recovery_point
                None,  # response
                1,  # attempt
            )
            return make_claim(True, record)
        return make_claim(verdict == "taken", record_from_packed(reply[1]))

    def owner_args(self, record: Record, now: float) -> list[Any]:
        return [ms(now), str(record.id), record.lease_token or ""]

    def complete_args(
        self, record: Record, state: State, response: Response, now: float, expires_at: float
    ) -> list[Any]:
        return [*self.owner_args(record, now), *_outcome(state, response), ms(expires_at)]

    def release_args(self, record: Record, now: float) -> list[Any]:
        return self.owner_args(record, now)

    def checkpoint_args(self, record: Record, recovery_point: str, now: float) -> list[Any]:
        return [*self.owner_args(record, now), recovery_point]

    def sweep_args(
        self, from_state: State, cutoff: float, now: float, keep_until: float, token: str
    ) -> list[Any]:
        return [ms(now), from_state.value, ms(cutoff), ms(keep_until), token]

    def marked_args(self, record: Record, now: float) -> list[Any]:
        """The sweeper's fence: the record as marked (id, token, updated_at)."""
        return [*self.owner_args(record, now), ms(record.updated_at)]

    def settle_stale_args(
        self, record: Record, state: State, response: Response, now: float, expires_at: float
    ) -> list[Any]:
        return [*self.marked_args(record, now), *_outcome(state, response), ms(expires_at)]

    def release_stale_args(self, record: Record, now: float, forget_progress: bool) -> list[Any]:
        return [*self.marked_args(record, now), "1" if forget_progress else "0"]


def _outcome(state: State, response: Response) -> list[Any]:
    return [state.value, response.status, headers_json(response.headers), response.body]


def swept_index(from_state: State) -> int:
    try:
        return SWEPT_FROM[from_state]
    except KeyError:
        msg = f"the sweeper marks in_progress, stale or released records, not {from_state.value}"
        raise ConfigurationError(msg) from None


def probe_args(index: int, now: float, bound: float, limit: int) -> tuple[int, list[Any]]:
    """The probe's arguments: entries below ``bound`` (up to it, for the expiry index)."""
    return index, [ms(now), ms(bound), limit, "1" if index == EXPIRES else "0"]


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


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
        response = make_response(int(status), body, stored_headers(get(b"response_headers")))
    lease_token = get(b"lease_token")
    correlation_id = get(b"correlation_id")
    recovery_point = get(b"recovery_point")
    attempt = get(b"attempt")
    return make_record(
        fields[b"id"].decode(),
        fields[b"principal"].decode(),
        fields[b"key"].decode(),
        fields[b"fingerprint"].decode(),
        fields[b"endpoint"].decode(),
        _STATES[fields[b"state"]],
        None if lease_token is None else lease_token.decode(),
        int(fields[b"created_at"]) / 1000,
        int(fields[b"updated_at"]) / 1000,
        int(fields[b"expires_at"]) / 1000,
        None if correlation_id is None else correlation_id.decode(),
        None if recovery_point is None else recovery_point.decode(),
        response,
        1 if attempt is None else int(attempt),
    )


def record_from_packed(packed: bytes) -> Record:
    """A record from a claim's reply: its :data:`RECORD_FIELDS` packed in one string (_PACKED).

    On the replay path: one pass over the string, slices only.
    """
    values: list[Any] = []  # bytes, or None for an absent field
    add = values.append
    find = packed.find
    at, end = 0, len(packed)
    while at < end:
        if packed[at] == _ABSENT:
            add(None)
            at += 1
            continue
        colon = find(b":", at)
        start = colon + 1
        at = start + int(packed[at:colon])
        add(packed[start:at])
    if len(values) != len(RECORD_FIELDS) or at != end:
        msg = f"a claim's packed record does not hold {len(RECORD_FIELDS)} fields"
        raise ValueError(msg)
    (
        id_,
        principal,
        key,
        fingerprint,
        endpoint,
        state,
        lease_token,
        created_at,
        updated_at,
        expires_at,
        correlation_id,
        recovery_point,
        status,
        headers,
        body,
        attempt,
    ) = values
    response = None
    if status is not None:
        response = make_response(int(status), body or b"", stored_headers(headers))
    return make_record(
        id_.decode(),
        principal.decode(),
        key.decode(),
        fingerprint.decode(),
        endpoint.decode(),
        _STATES[state],
        None if lease_token is None else lease_token.decode(),
        int(created_at) / 1000,
        int(updated_at) / 1000,
        int(expires_at) / 1000,
        None if correlation_id is None else correlation_id.decode(),
        None if recovery_point is None else recovery_point.decode(),
        response,
        1 if attempt is None else int(attempt),
    )


_ABSENT = ord("-")
_STATES = {state.value.encode(): state for state in State}


def layout_for(client: Any, prefix: str) -> Layout:
    """Check the client can carry bytes."""
    if client.get_encoder().decode_responses:
        msg = (
            "the Redis client must not decode responses (decode_responses=False): "
            "stored bodies are bytes"
        )
        raise ConfigurationError(msg)
    return Layout(prefix)


def record_from_reply(flat: Any) -> Record | None:
    """HGETALL answers a list (RESP2 raw) or a dict (parsed); empty when absent."""
    if not flat:
        return None
    if isinstance(flat, dict):
        flat = [item for pair in flat.items() for item in pair]
    return record_from_hash(flat)


def refuse_transaction(transaction: object) -> None:
    """The driver refuses first; a direct caller is told the same."""
    if transaction is not None:
        msg = "the Redis store cannot share the caller's transaction"
        raise ConfigurationError(msg)


def data_lost(left: float) -> StoreUnavailable:
    """The 503 of a claim that would write in a bucket that may have lost data, until its
    quarantine ends."""
    return StoreUnavailable(
        "the Redis key store restarted or lost data (restarted, flushed, or failed over): "
        "new claims wait until requests in flight before it have ended",
        retry_after=max(1, math.ceil(left)),
    )


def persistence_problem(configs: Sequence[Mapping[str, Any]]) -> str | None:
    """Why these nodes' ``CONFIG GET appendonly`` / ``save`` answers lose data on restart,
    or None when each node keeps an AOF or RDB snapshots."""
    for config in configs:
        values = {text(name): text(value) for name, value in config.items()}
        if "unknown" in values:
            return f"{values['node']}: cannot tell, {values['unknown']}"
        if values.get("appendonly", "no") != "yes" and not values.get("save", "").strip():
            node = values.get("node", "the server")
            return f"{node} has neither AOF (appendonly no) nor RDB snapshots (save '')"
    return None


def refuse_volatile(problem: str | None) -> None:
    if problem is None:
        return
    msg = (
        f"refusing a Redis that forgets every claim when it restarts: {problem}. Enable "
        "persistence (appendonly yes, appendfsync everysec or always), or acknowledge it "
        "with allow_volatile=True (?allow_volatile=1 in a URL): see docs/stores.md"
    )
    raise ConfigurationError(msg)


class AsyncStartGate:
    """One caller at a time starts an async store: the first claims of many tasks wait for it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> None:
        await self._lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._lock.release()


class StartGate:
    """:class:`AsyncStartGate` for threads (the sync store)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()
