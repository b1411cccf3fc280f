"""The Redis store's rules, without I/O: where records and indexes live, the Lua scripts
that decide, how their arguments are spelled and their replies read (docs/stores.md, "Redis"),
and what the async store and its sync twin share.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..._errors import ConfigurationError, StoreUnavailable
from ..._model import (
    DEFAULT_STALE_SECONDS,
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
from ..protocol import StoreClock, check_clock

DEFAULT_PREFIX = "idemflow"

#: How many buckets (hash tags, so slots) one prefix spreads over; a key's name depends on it.
BUCKETS = 1024
#: Buckets probed per pipelined round trip when the sweeper or purge walks them.
PROBE_CHUNK = 128
#: Round trips a walk over the buckets may take when each meets a connection closed idle.
WALK_ATTEMPTS = 3
#: The boot script's ARGV[2]: what it does with an epoch that is absent (see _BOOT).
KEEP_ABSENT, CREATE_ABSENT, ARM_ABSENT = "0", "1", "2"

#: A bucket's indexes, in the order every script gets them as KEYS[1..4].
IN_PROGRESS, STALE, RELEASED, EXPIRES = range(4)
INDEXES = ("in_progress", "stale", "released", "expires")
#: The index each state the sweeper marks from is found in.
SWEPT_FROM = {State.IN_PROGRESS: IN_PROGRESS, State.STALE: STALE, State.RELEASED: RELEASED}

#: A record's hash fields, in the order a packed record and ``HMGET`` give them.
RECORD_FIELDS = (
    "id", "principal", "key", "fingerprint", "endpoint", "state", "lease_token", "created_at",
    "updated_at", "expires_at", "correlation_id", "recovery_point", "response_status",
    "response_headers", "response_body", "attempt", "stale_at",
)  # fmt: skip

# Every script is safe to resend (a retried write finds its own result): a URL's client retries.
RETRIES = 2


def attempt_timeout(policy: Policy) -> float:
    """Each attempt's connect and socket timeout: all attempts share ``store_wait_seconds``."""
    return policy.store_wait_seconds / (1 + RETRIES)


# ARGV[1]: the caller's now (ms), then the script's other plain words (numbers, a state),
# space-separated: A[1], A[2], … (one argument costs the client less than several).
_WORDS = """
local A = {}
for word in string.gmatch(ARGV[1], '%S+') do A[#A + 1] = word end
"""
# ``now`` (ms): Redis's TIME by default; ``at()`` keeps an instant's distance from the
# caller's now, A[1] (also ``created_at``, an identity never compared).
_ON_STORE_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
_ON_CALLER_CLOCK = """
local now = tonumber(A[1])
"""
_CLOCK = """
local function at(instant) return now + (tonumber(instant) - tonumber(A[1])) end
local function ms(number) return string.format('%d', number) end
local NOW = ms(now)
"""

# Each record's own stale threshold (``stale_after``, ms, chosen at its claim): every owner
# write that dates it sets its deadline ``stale_at`` that far on, the score of its index
# entry (in_progress; released past a recovery point). A record of an earlier version has
# none: the default policy's.
_DEADLINE = f"""
local function deadline(after)
  return ms(now + (tonumber(after) or {int(DEFAULT_STALE_SECONDS * 1000)}))
end
"""

# Every script but the probe: KEYS[1..4] the bucket's indexes, then the record(s).
_INDEXES = """
local IP, ST, REL, EXP = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
"""

# Only the scripts that settle or delete define these: a script pays for its closures per call.
_RETENTION = """
-- Nothing left to resolve: in the expiry index, with the rest of its retention as TTL.
-- Released past a recovery point: the sweeper's (and its retry's), never expires.
local function retain(k, expires, progress, due)
  if progress then
    redis.call('ZADD', REL, due, k)
  else
    redis.call('ZADD', EXP, expires, k)
    redis.call('PEXPIRE', k, ms(math.max(1, tonumber(expires) - now)))
  end
end

-- Delete k if past retention (1); drop an entry whose record is gone (1); fix a stale
-- score or drop an entry of another state (0).
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

-- Each settling write purges up to two records past retention: the index stays bounded.
local function trim(own)
  for _, k in ipairs(redis.call('ZRANGEBYSCORE', EXP, '-inf', NOW, 'LIMIT', 0, 2)) do
    if k ~= own then purge_one(k) end
  end
end
"""

# A record in one bulk string (not HGETALL's 32 elements): a `struct` format, '<length>s'
# per field or '?' for an absent one, a newline, then the values (a NUL for an absent one,
# read as False): the client splits it in one call (see `unpacked`).
_PACKED = (
    "local FIELDS = {"
    + ", ".join(f"'{name}'" for name in RECORD_FIELDS)
    + """}
local function packed(k)
  local values = redis.call('HMGET', k, unpack(FIELDS))
  local form = {'='}
  for i = 1, #FIELDS do
    if values[i] then
      form[i + 1] = #values[i] .. 's'
    else
      form[i + 1], values[i] = '?', '\\0'
    end
  end
  return table.concat(form) .. '\\n' .. table.concat(values)
end
"""
)

# KEYS[5] the record, KEYS[6] the bucket's epoch (the benchmark's raw calls leave it out).
# A: now, expires_at, quarantine, stale_after (ms); ARGV[2..4]: lease_token, fingerprint,
# endpoint, then correlation_id if there is one; principal and key are read from the
# record's name (`Layout.record_key`). Replies 'new <updated_at> <expires_at> <stale_at>',
# 'taken <packed record>', 'held <packed record>', or 'lost <ms left>' ('found …' when it
# found the epoch gone). An epoch "<armed_ms> <run_id>" gone or on another boot: a claim
# that would write waits.
_CLAIM = """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'state', 'fingerprint', 'expires_at', 'lease_token',
  'recovery_point')
local state = cur[1]
local retry = false
if state then
  if state == 'in_progress' and cur[4] == ARGV[2] then
    return 'taken ' .. packed(K)
  end
  retry = state == 'released' and cur[2] == ARGV[3]
  local past = tonumber(cur[3]) <= now and (state == 'completed' or state == 'failed_permanent'
    or (state == 'released' and not cur[5]))
  if not (retry or past) then
    return 'held ' .. packed(K)
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
  local left = armed + tonumber(A[3]) - now
  if left > 0 then
    if epoch then return 'lost ' .. ms(left) end
    return 'found ' .. ms(left)
  end
end
if state then
  redis.call('ZREM', EXP, K)
  redis.call('ZREM', REL, K)
end
local expires = ms(at(A[2]))
if retry then
  redis.call('HDEL', K, 'response_status', 'response_headers', 'response_body', 'correlation_id')
  redis.call('HINCRBY', K, 'attempt', 1)
  redis.call('PERSIST', K)
else
  if state then redis.call('DEL', K) end
  local size, name = string.match(K, '}:k:(%d+):(.*)$')
  size = tonumber(size)
  redis.call('HSET', K, 'id', ARGV[2], 'principal', string.sub(name, 1, size),
    'key', string.sub(name, size + 2), 'created_at', A[1], 'attempt', 1)
end
local due = deadline(A[4])
redis.call('HSET', K, 'state', 'in_progress', 'lease_token', ARGV[2], 'fingerprint', ARGV[3],
  'endpoint', ARGV[4], 'updated_at', NOW, 'expires_at', expires, 'stale_after', A[4],
  'stale_at', due)
if ARGV[5] then redis.call('HSET', K, 'correlation_id', ARGV[5]) end
redis.call('ZADD', IP, due, K)
if retry then return 'taken ' .. packed(K) end
return 'new ' .. NOW .. ' ' .. expires .. ' ' .. due
"""

# Tells each epoch the server's boot (run_id); ARGV[2] says what an absent one becomes. An
# epoch last seen on another boot is armed from that boot (now - uptime). Returns the run_id.
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

# Every owner write's fence: our id and lease token, in progress; a resent write finds its
# own result (``done``) and succeeds again.
_FENCE = """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'id', 'lease_token', 'state', 'expires_at', 'recovery_point',
  'stale_after')
if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[3] then return 0 end
if cur[3] == done then return 1 end
if cur[3] ~= 'in_progress' then return 0 end
"""

# A settled outcome stored, by its owner or the sweeper. A: now, expires_at (retention from
# now), status, state.
_SETTLE = """
local function settle(headers, body)
  local expires = ms(at(A[2]))
  redis.call('HSET', K, 'state', A[4], 'response_status', A[3], 'response_headers', headers,
    'response_body', body, 'updated_at', NOW, 'expires_at', expires)
  retain(K, expires, false)
  trim(K)
  return 1
end
"""

# ARGV[4..5]: headers, body.
_COMPLETE = """
redis.call('ZREM', IP, K)
return settle(ARGV[4], ARGV[5])
"""

# The claim's expires_at bounds a released record.
_RELEASE = """
local due = deadline(cur[6])
redis.call('HSET', K, 'state', 'released', 'updated_at', NOW, 'stale_at', due)
redis.call('ZREM', IP, K)
retain(K, cur[4], cur[5], due)
trim(K)
return 1
"""

# A checkpoint (ARGV[4] its recovery_point) or a consumer's lease renewed (no ARGV[4]): both
# count as life, the claim dated now (its deadline too).
_ALIVE = """
local due = deadline(cur[6])
if ARGV[4] then redis.call('HSET', K, 'recovery_point', ARGV[4]) end
redis.call('HSET', K, 'updated_at', NOW, 'stale_at', due)
redis.call('ZADD', IP, due, K)
return 1
"""

# KEYS[1]: one index. ARGV: now, bound, limit, '1' if inclusive. What is due, oldest first.
_PROBE = """
local bound = ms(at(ARGV[2]))
if ARGV[4] ~= '1' then bound = '(' .. bound end
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', bound, 'LIMIT', 0, tonumber(ARGV[3]))
"""

# KEYS[1]: one index. ARGV: now, cutoff. ms until its oldest entry is due (nil: empty).
_DUE = """
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return false end
return ms(tonumber(first[2]) - at(ARGV[2]))
"""

# KEYS[5…]: records the probe found due. ARGV: now, from_state, cutoff, keep_until, token.
# Each whose own deadline is before the cutoff is marked with the sweeper's token (dated
# now, its mark); another's entry gets its deadline as score. Returns the marked, packed.
_SWEEP = """
local from = ARGV[2]
local index = (from == 'in_progress' and IP) or (from == 'stale' and ST) or REL
local cutoff, keep = at(ARGV[3]), at(ARGV[4])
local marked = {}
for i = 5, #KEYS do
  local k = KEYS[i]
  local cur = redis.call('HMGET', k, 'state', 'updated_at', 'expires_at', 'recovery_point',
    'stale_after')
  -- Dated by its last write: stale_at is this version's copy of the deadline, absent or
  -- older on a record an earlier version wrote during a rolling upgrade.
  local due = tonumber(cur[2])
  if due and cur[1] ~= 'stale' then due = tonumber(deadline(cur[5])) - now + due end
  if cur[1] ~= from or (from == 'released' and not cur[4]) then
    redis.call('ZREM', index, k)
  elseif due < cutoff then
    local expires = cur[3]
    if tonumber(expires) < keep then expires = ms(keep) end
    redis.call('HSET', k, 'state', 'stale', 'lease_token', ARGV[5], 'updated_at', NOW,
      'expires_at', expires, 'stale_at', NOW)
    redis.call('ZREM', index, k)
    redis.call('ZADD', ST, NOW, k)
    marked[#marked + 1] = packed(k)
  else
    redis.call('ZADD', index, ms(due), k)
  end
end
return marked
"""

# A sweeper's write is fenced on the record as it marked it. ARGV[2..4]: id, token, marked_at.
_MARKED = """
local K = KEYS[5]
local cur = redis.call('HMGET', K, 'id', 'lease_token', 'state', 'updated_at', 'expires_at',
  'recovery_point', 'stale_after')
if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[3] or cur[3] ~= 'stale' or cur[4] ~= ARGV[4] then
  return 0
end
redis.call('ZREM', ST, K)
"""

# ARGV[5..6]: headers, body.
_SETTLE_STALE = """
return settle(ARGV[5], ARGV[6])
"""

# ARGV[5]: '1' to forget the recovery point (the reconciler undid its traces).
_RELEASE_STALE = """
local progress = cur[6]
if ARGV[5] == '1' then
  progress = false
  redis.call('HDEL', K, 'recovery_point')
end
local due = deadline(cur[7])
redis.call('HSET', K, 'state', 'released', 'updated_at', NOW, 'stale_at', due)
retain(K, cur[5], progress, due)
trim(K)
return 1
"""

# KEYS[5…]: records the probe listed as past retention. ARGV: now.
_PURGE = """
local purged = 0
for i = 5, #KEYS do purged = purged + purge_one(KEYS[i]) end
return purged
"""

#: Each script's body and what it needs before it: indexes, retention helpers, its fence.
_BODIES = {
    "claim": (_INDEXES + _PACKED + _DEADLINE, _CLAIM),
    "complete": (_INDEXES + _RETENTION + "local done = A[4]" + _FENCE + _SETTLE, _COMPLETE),
    "release": (
        _INDEXES + _RETENTION + _DEADLINE + "local done = 'released'" + _FENCE,
        _RELEASE,
    ),
    "checkpoint": (_INDEXES + _DEADLINE + "local done = nil" + _FENCE, _ALIVE),
    "renew": (_INDEXES + _DEADLINE + "local done = nil" + _FENCE, _ALIVE),
    "probe": ("", _PROBE),
    "due": ("", _DUE),
    "sweep": (_INDEXES + _PACKED + _DEADLINE, _SWEEP),
    "settle_stale": (_INDEXES + _RETENTION + _MARKED + _SETTLE, _SETTLE_STALE),
    "release_stale": (_INDEXES + _RETENTION + _DEADLINE + _MARKED, _RELEASE_STALE),
    "purge": (_INDEXES + _RETENTION, _PURGE),
}


def _compiled(start: str) -> tuple[dict[str, str], dict[str, bytes]]:
    texts = {name: start + head + body for name, (head, body) in _BODIES.items()}
    return texts, {
        name: hashlib.sha1(lua.encode()).hexdigest().encode() for name, lua in texts.items()
    }


#: What every script starts with, per clock: its words, ``now``, the time helpers.
_STARTS = {
    "database": _WORDS + _ON_STORE_CLOCK + _CLOCK,
    "caller": _WORDS + _ON_CALLER_CLOCK + _CLOCK,
}
#: Per clock, every script's text and the SHA-1 ``EVALSHA`` names (bytes: encoded once).
ON_CLOCK = {clock: _compiled(start) for clock, start in _STARTS.items()}
#: The scripts a store on Redis's clock (the default) runs, and their SHA-1s.
SCRIPTS = ON_CLOCK["database"][0]
SHAS = {name: sha.decode() for name, sha in ON_CLOCK["database"][1].items()}
#: The boot script per clock: ``"keys"`` with the epochs as KEYS (one server, or one slot);
#: ``"node"`` with one master's epochs as ARGV[3…] (``allow-cross-slot-keys``, Redis >= 7).
BOOT_SCRIPTS = {
    clock: {
        "keys": start + "local epochs = KEYS\n" + _BOOT,
        "node": f"#!lua flags=allow-cross-slot-keys\n{start}local epochs = {{unpack(ARGV, 3)}}\n"
        + _BOOT,
    }
    for clock, start in _STARTS.items()
}


def is_unavailable(exc: BaseException) -> bool:
    """Cannot reach Redis, or the cluster is moving a slot or electing a master."""
    from redis import exceptions as e

    down = (e.ConnectionError, e.TimeoutError, e.ClusterDownError, e.ClusterError)
    moving = (e.TryAgainError, e.MasterDownError, e.ReadOnlyError, e.SlotNotCoveredError)
    return isinstance(exc, (*down, *moving, e.RedisClusterException, TimeoutError))


def is_connection_lost(exc: BaseException) -> bool:
    """A connection ended or refused (not a timeout): a read may be sent again on another."""
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
        raise_unavailable(exc)
        raise


@dataclass(frozen=True, slots=True)
class Layout:
    """Where records and indexes live under ``prefix``, and the claim's arguments (no I/O)."""

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
        """``prefix:{bucket}:k:len:principal:key`` (length-prefixed: no two pairs share it)."""
        return self._locate(principal, key)[1]

    def keys(self, principal: str, key: str) -> tuple[bytes, ...]:
        """What a record's scripts get as KEYS: its bucket's four indexes, then the record."""
        bucket, record = self._locate(principal, key)
        return (*self._indexes[bucket], record)

    def claim_keys(self, principal: str, key: str) -> tuple[bytes, ...]:
        """The claim's KEYS: those of `keys`, then the bucket's epoch."""
        bucket, record = self._locate(principal, key)
        return (*self._indexes[bucket], record, self._epochs[bucket])

    def epoch_key(self, bucket: int) -> bytes:
        """The bucket's epoch (same slot): its absence tells the claim that data was lost."""
        return self._epochs[bucket]

    def epoch_keys(self) -> list[bytes]:
        return list(self._epochs)

    def indexes(self, bucket: int) -> tuple[bytes, ...]:
        """A bucket's indexes: in_progress, stale, released, expires (all in one slot)."""
        return self._indexes[bucket]

    def record_pattern(self) -> str:
        """A ``SCAN MATCH`` pattern for every record of this prefix (not the indexes)."""
        return _glob_escape(self.prefix) + ":{*}:k:*"

    def walk(self) -> Iterator[tuple[int, ...]]:
        """Every bucket once, in chunks of `PROBE_CHUNK`, from a random one."""
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

    def claim_args(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        quarantine: float = 0,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> list[bytes]:
        """The claim's ARGV (see _CLAIM), pre-encoded: redis-py encodes a str or an int
        argument at twice a bytes one's cost (the claim and completion are a protected
        request's only commands)."""
        times = (now * 1000, expires_at * 1000, quarantine * 1000, stale_after * 1000)
        args = [b"%d %d %d %d" % times, lease_token.encode(), intent.fingerprint.encode()]
        args.append(intent.endpoint.encode())
        if intent.correlation_id is not None:
            args.append(intent.correlation_id.encode())
        return args

    def claimed(self, reply: bytes, intent: Intent, lease_token: str, now: float) -> Claim:
        verdict, _, rest = reply.partition(b" ")
        if verdict == b"new":
            updated_at, expires_at, stale_at = rest.split(b" ")  # as the script wrote them
            # The id is the lease token, created_at the caller's now.
            record = make_record(
                lease_token, intent.principal, intent.key, intent.fingerprint, intent.endpoint,
                State.IN_PROGRESS, lease_token, ms(now) / 1000, int(updated_at) / 1000,
                int(expires_at) / 1000, intent.correlation_id, None, None, 1, int(stale_at) / 1000,
            )  # fmt: skip
            return make_claim(True, record)
        if verdict in (b"lost", b"found"):
            raise data_lost(int(rest) / 1000)
        return make_claim(verdict == b"taken", unpacked(rest))

    def complete_args(
        self, record: Record, state: State, response: Response, now: float, expires_at: float
    ) -> list[bytes]:
        return settled_args(record, state, response, now, expires_at)


def fence(record: Record) -> tuple[bytes, bytes]:
    """What every owner write is fenced on: the record's id and lease token."""
    return str(record.id).encode(), (record.lease_token or "").encode()


def owner_args(record: Record, now: float, *more: Any) -> list[Any]:
    """An owner write's ARGV: now, the `fence`, then ``more``."""
    return [b"%d" % (now * 1000), *fence(record), *more]


def settled_args(
    record: Record, state: State, response: Response, now: float, expires_at: float, *mark: Any
) -> list[Any]:
    """A settling write's ARGV: now, expires_at, status and state as words; the `fence`; the
    sweeper's ``mark`` if it is its write; headers, body."""
    times = (now * 1000, expires_at * 1000, response.status, state.value.encode())
    headers = headers_json(response.headers).encode()
    return [b"%d %d %d %s" % times, *fence(record), *mark, headers, response.body]


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
    """A record from ``HGETALL``'s flat ``field, value, …`` reply (tests, old callers)."""
    pairs = iter(flat)
    fields = dict(zip(pairs, pairs, strict=True))
    return unpacked(packed_from([fields.get(name) for name in FIELDS]))


def record_from_fields(values: Sequence[bytes | None]) -> Record | None:
    """A record from ``HMGET``'s reply of its `RECORD_FIELDS`; None when it has no id."""
    return None if values[0] is None else unpacked(packed_from(values))


def packed_from(values: Sequence[bytes | None]) -> bytes:
    """What a script's ``packed()`` makes of these field values (None: absent)."""
    form = b"".join(b"?" if value is None else b"%ds" % len(value) for value in values)
    return b"=%s\n%s" % (form, b"".join(b"\0" if value is None else value for value in values))


def unpacked(packed: bytes) -> Record:
    """The one decoder: a record from a script's reply (see _PACKED), split by `struct`."""
    form, _, data = packed.partition(b"\n")
    id_, principal, key, fingerprint, endpoint, state, lease_token, created_at, updated_at, \
        expires_at, correlation_id, recovery_point, status, headers, body, attempt, stale_at \
        = struct.unpack(form, data)  # fmt: skip
    if id_ is False:
        raise ValueError("a packed record has no id")
    response = None
    if status is not False:
        response = make_response(int(status), body or b"", stored_headers(headers or b""))
    return make_record(
        id_.decode(),
        principal.decode(),
        key.decode(),
        fingerprint.decode(),
        endpoint.decode(),
        _STATES[state],
        None if lease_token is False else lease_token.decode(),
        int(created_at) / 1000,
        int(updated_at) / 1000,
        int(expires_at) / 1000,
        None if correlation_id is False else correlation_id.decode(),
        None if recovery_point is False else recovery_point.decode(),
        response,
        1 if attempt is False else int(attempt),
        None if stale_at is False else int(stale_at) / 1000,
    )


_STATES = {state.value.encode(): state for state in State}
FIELDS = tuple(name.encode() for name in RECORD_FIELDS)


def layout_for(client: Any, prefix: str) -> Layout:
    """Check the client can carry bytes."""
    if client.get_encoder().decode_responses:
        msg = (
            "the Redis client must not decode responses (decode_responses=False): "
            "stored bodies are bytes"
        )
        raise ConfigurationError(msg)
    return Layout(prefix)


def refuse_transaction(transaction: object) -> None:
    """The driver refuses first; a direct caller is told the same."""
    if transaction is not None:
        msg = "the Redis store cannot share the caller's transaction"
        raise ConfigurationError(msg)


def data_lost(left: float) -> StoreUnavailable:
    """The 503 of a claim that would write in a bucket that may have lost data."""
    return StoreUnavailable(
        "the Redis key store restarted or lost data (restarted, flushed, or failed over): "
        "new claims wait until requests in flight before it have ended",
        retry_after=max(1, math.ceil(left)),
    )


def refuse_volatile(configs: Sequence[Mapping[str, Any]]) -> None:
    """Refuse nodes whose ``CONFIG GET appendonly`` / ``save`` answers lose data on restart."""
    for config in configs:
        values = {text(name): text(value) for name, value in config.items()}
        node = values.get("node", "the server")
        if "unknown" in values:
            problem = f"{node}: cannot tell, {values['unknown']}"
        elif values.get("appendonly", "no") != "yes" and not values.get("save", "").strip():
            problem = f"{node} has neither AOF (appendonly no) nor RDB snapshots (save '')"
        else:
            continue
        msg = (
            f"refusing a Redis that forgets every claim when it restarts: {problem}. Enable "
            "persistence (appendonly yes, appendfsync everysec or always), or acknowledge it "
            "with allow_volatile=True (?allow_volatile=1 in a URL): see docs/stores.md"
        )
        raise ConfigurationError(msg)


#: One caller at a time starts a store: the first claims of many tasks (threads) wait.
AsyncStartGate = asyncio.Lock
StartGate = threading.Lock


#: How long claims are refused after a loss when no policy was given: ``Policy()``'s.
_DEFAULT_QUARANTINE = Policy().stale_seconds


#: What an owner's write refused for its lease lost says.
LOST = "the claim on this Idempotency-Key was taken over or swept"


class RedisShared:
    """What `AsyncRedisStore` and `RedisStore` share that is no coroutine."""

    supports_transactions = False
    supports_single_commit = False
    renews_claims = True
    #: The lock the first claims wait on while one of them starts the store.
    _gate_kind: Callable[[], Any]

    def __init__(
        self,
        client: Any,
        *,
        policy: Policy | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: StoreClock = "database",
        allow_volatile: bool = False,
    ) -> None:
        from redis.exceptions import NoScriptError, ResponseError

        self.client = client
        self.layout = layout_for(client, prefix)
        self._scripts, self._shas = ON_CLOCK[check_clock(clock)]
        self._boot_scripts = BOOT_SCRIPTS[clock]
        self._gate = self._gate_kind()
        self._cluster = hasattr(client, "get_primaries")
        self._no_script = NoScriptError
        self._response_error = ResponseError
        self.allow_volatile = allow_volatile
        self._quarantine = None if policy is None else policy.stale_seconds
        self._started = False

    @property
    def quarantine(self) -> float:
        """Seconds claims are refused in a bucket that lost data (the longest threshold told)."""
        return _DEFAULT_QUARANTINE if self._quarantine is None else self._quarantine

    def cover_stale_threshold(self, seconds: float) -> None:
        """A driver's stale threshold: claims after a loss wait at least that long."""
        self._quarantine = max(self._quarantine or 0.0, seconds)

    def _each(self, script: str, chunk: Sequence[int], index: int, argv: list[Any]) -> Any:
        pipe = self.client.pipeline(transaction=False)
        for bucket in chunk:
            # execute_command: redis-py's cluster pipeline refuses its evalsha()
            # method, yet routes the command itself by its one key (one slot).
            name = self.layout.indexes(bucket)[index]
            pipe.execute_command("EVALSHA", self._shas[script], 1, name, *argv, **self._route(name))
        return pipe

    def _route(self, key: bytes) -> dict[str, Any]:
        """A one-key script's node, named on a cluster (else redis-py asks ``COMMAND GETKEYS``)."""
        return {"target_nodes": self.client.get_node_from_key(key)} if self._cluster else {}
