"""
The Redis store's I/O: every operation one script call (or one pipelined walk).

The rules it sends (key layout, Lua scripts, argument spelling) live in
``_scripts.py`` next to it. Import both stores from :mod:`idemflow.stores.redis`.

This is the async source of truth; ``idemflow/stores/redis/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..._errors import LeaseLost
from ..._lease import new_lease_token
from ..._model import Claim, Intent, Policy, Record, Response, State
from ..protocol import AsyncMaintainableStore, AsyncTransaction, StoreClock, check_clock
from ._scripts import (
    ARM_ABSENT,
    BOOT_SCRIPTS,
    CREATE_ABSENT,
    DEFAULT_PREFIX,
    EXPIRES,
    KEEP_ABSENT,
    ON_CLOCK,
    WALK_ATTEMPTS,
    AsyncStartGate,
    is_connection_lost,
    layout_for,
    ms,
    persistence_problem,
    probe_args,
    raise_unavailable,
    record_from_hash,
    record_from_reply,
    refuse_transaction,
    refuse_volatile,
    shorten_waits,
    swept_index,
    translated,
)
from ._stats import AsyncRedisObservable

__all__ = ["AsyncRedisStore"]

#: How long claims are refused after a loss when no policy was given: ``Policy()``'s.
_DEFAULT_QUARANTINE = Policy().stale_seconds


class AsyncRedisStore(AsyncRedisObservable, AsyncMaintainableStore):
    """Key records in Redis or Redis Cluster, on a redis-py client (``redis.asyncio``'s for async).

    Args:
        client: a redis-py client with ``decode_responses=False``. Bound its
            retries (``retry=Retry(…, retries=2)``, ``socket_timeout``): an
            outage is answered 503 only once they are spent. Every script is
            safe to retry. ``redis.asyncio``'s client needs the ``Retry`` of
            ``redis.asyncio.retry``: given redis-py's sync one, it never retries.
        policy: your app's policy: its stale threshold is how long claims
            are refused after a data loss is found (below). Optional: each
            idempotency driver made on the store tells it its own policy's
            threshold, and the store keeps the longest it was given
            (``Policy()``'s if none). A record's life does not depend on
            it (claims end through the sweeper; retention comes with each write).
        prefix: the start of every key this store writes.
        clock: ``"database"`` (the default): every decision is taken on Redis's
            own clock (``TIME`` in each script; on each master's in a cluster),
            and the instants a caller computes (an expiry, the sweeper's cutoff)
            keep only their distance from the caller's now, so app servers and
            sweepers whose clocks disagree still agree on what is stale or
            expired. ``"caller"``: the caller's ``now`` as given (tests that
            move a frozen clock).
        allow_volatile: accept a server that keeps neither an AOF nor RDB
            snapshots. Without it the first claim checks every master
            (``CONFIG GET appendonly`` / ``save``) and raises
            ``ConfigurationError``: restarted, such a server forgets every
            claim, and requests in flight run a second time.

    A data loss while running is detected: the store writes each bucket's
    epoch key when it starts, with the server's boot (``INFO``'s ``run_id``).
    A bucket whose epoch is gone (its data vanished), or was last seen on
    another boot (the server restarted or failed over, and may have lost its
    last writes), answers the claims that would write a record 503 +
    ``Retry-After`` until the stale threshold has passed since the loss was
    found, or since the boot: no request in flight before it can run again
    while it may still be running. The first claim that finds an epoch gone
    arms every epoch that is gone with it, so every bucket the loss took
    opens again a threshold after that discovery. Replays, 409s and 422s
    answer throughout.

    ``supports_transactions`` is False: ``Idempotency.run(…, transaction=…)``
    raises ``ConfigurationError`` before claiming anything. Run the sweeper
    (``idemflow sweep redis://…``) as for the SQL stores: a crashed claim
    stays ``in_progress`` until it marks it stale.
    """

    supports_transactions = False
    supports_single_commit = False

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
        self._gate = AsyncStartGate()
        self._cluster = hasattr(client, "get_primaries")
        self._no_script = NoScriptError
        self._response_error = ResponseError
        self.allow_volatile = allow_volatile
        # The policy's stale threshold, or None until a driver tells us its own.
        self._quarantine = None if policy is None else policy.stale_seconds
        self._started = False

    @property
    def quarantine(self) -> float:
        """How long claims are refused in a bucket whose data vanished (seconds): the
        longest stale threshold of the store's policy and of every driver's
        (:meth:`cover_stale_threshold`); ``Policy()``'s when none was given."""
        return _DEFAULT_QUARANTINE if self._quarantine is None else self._quarantine

    def cover_stale_threshold(self, seconds: float) -> None:
        """A driver's stale threshold: claims after a loss wait at least that long."""
        self._quarantine = max(self._quarantine or 0.0, seconds)

    def cover_store_wait(self, seconds: float) -> None:
        """A driver's store wait: each call, its retries included, fits in it."""
        shorten_waits(self.client, seconds, cluster=self._cluster)

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim:
        refuse_transaction(transaction)
        if not self._started:
            async with self._gate:  # the first claims of many callers: one starts the store
                if not self._started:
                    await self.start(now)
        args = self.layout.claim_args(intent, lease_token, now, expires_at, self.quarantine)
        keys = self.layout.claim_keys(intent.principal, intent.key)
        # try/except, not translated(): a generator context manager per call costs.
        try:
            reply = await self._evalsha("claim", keys, args)
            if self.layout.found_loss(reply):
                await self._arm_lost_buckets(args[0])
        except Exception as exc:
            raise_unavailable(exc)
            raise
        return self.layout.claimed(reply, intent, lease_token, now, expires_at)

    async def _arm_lost_buckets(self, now_ms: int) -> None:
        """A claim found its bucket's epoch gone: arm every epoch that is gone from now.

        A loss (a restart without persistence, ``FLUSHALL``, an empty replica
        promoted) takes every bucket of its server (of its master, on a cluster)
        at once. Left to each bucket's first claim, the quarantine of a bucket
        first asked later would end that much later than the loss; armed here,
        it ends a stale threshold after the first discovery wherever the next
        claim falls. Any instant after the loss is safe to arm from (a claim lost
        with the data had begun before it); an epoch still there is only told
        the boot, as always. On a cluster, once per master (the boot script).
        """
        await self._boot(now_ms, ARM_ABSENT)

    async def start(self, now: float | None = None) -> None:
        """Refuse a volatile server (unless allowed), write every bucket's epoch, load the scripts.

        Run by the first claim (``now`` on the caller's clock; the time by
        default); safe to run again. An epoch that exists learns the server's
        boot, or is armed if it saw another (see :meth:`_prepare`). A store
        started after a loss cannot tell an emptied server from a new one: it
        is the stores running during the loss that find it, and every store
        finds a restart.
        """
        at = ms(time.time() if now is None else now)
        with translated():
            if not self.allow_volatile:
                refuse_volatile(persistence_problem(await self._persistence()))
            await self._prepare(at, create=True)
        self._started = True

    async def _prepare(self, now_ms: int, *, create: bool = False) -> None:
        """The boot script on every bucket's epoch, then every script loaded.

        Whenever scripts are loaded into a server (at start, when one is
        missing: a restart, a failover, ``SCRIPT FLUSH``): no claim can run on
        a boot whose epochs were not compared with it first. On one server
        both travel in one pipeline, on one connection, so a restart cannot
        fall between them (a connection does not survive one). On a cluster
        they are separate calls, so the boot runs again after the load: a
        master that restarted in between is found then (what another store
        claimed there in those milliseconds is not).
        """
        absent = CREATE_ABSENT if create else KEEP_ABSENT
        if self._cluster:
            await self._boot(now_ms, absent)
            for lua in self._scripts.values():
                await self.client.script_load(lua)
            await self._boot(now_ms, absent)
            return
        epochs = self.layout.epoch_keys()
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(self._boot_scripts["keys"], len(epochs), *epochs, now_ms, absent)
        for lua in self._scripts.values():
            pipe.script_load(lua)
        await pipe.execute()

    async def _boot(self, now_ms: int, absent: str) -> None:
        """The boot script on every bucket's epoch; ``absent`` says what a missing one becomes."""
        epochs = self.layout.epoch_keys()
        argv = [now_ms, absent]
        if self._cluster:
            await self._boot_cluster(epochs, argv)
        else:
            await self.client.eval(self._boot_scripts["keys"], len(epochs), *epochs, *argv)

    async def _boot_cluster(self, epochs: list[bytes], argv: list[Any]) -> None:
        """The boot script once per master, on the epochs of the buckets it serves.

        Where that is refused (a server before Redis 7, a slot that moved since
        the client last looked), once per bucket: slower (an ``INFO`` each),
        never wrong.
        """
        await self._learn_slots()
        served: dict[str, list[bytes]] = {}
        for epoch in epochs:
            served.setdefault(self.client.get_node_from_key(epoch).name, []).append(epoch)
        try:
            for name, mine in served.items():
                node = self.client.get_node(node_name=name)
                lua = self._boot_scripts["node"]
                await self.client.execute_command(
                    "EVAL", lua, 1, mine[0], *argv, *mine, target_nodes=node
                )
        except self._response_error:
            pipe = self.client.pipeline(transaction=False)
            for epoch in epochs:  # one slot per script: routed by its one key
                lua = self._boot_scripts["keys"]
                pipe.execute_command("EVAL", lua, 1, epoch, *argv, **self._route(epoch))
            await pipe.execute()

    async def _persistence(self) -> list[dict[str, Any]]:
        """Each master's ``appendonly`` and ``save`` settings (every master of a cluster)."""
        primaries = getattr(self.client, "get_primaries", None)
        targets: list[Any] = [None] if primaries is None else list(primaries())
        configs = []
        for node in targets:
            where = {} if node is None else {"target_nodes": node}
            config = {"node": "the server" if node is None else f"{node.host}:{node.port}"}
            try:
                for name in ("appendonly", "save"):
                    config.update(await self.client.config_get(name, **where))
            except self._response_error as exc:  # CONFIG renamed or denied (managed Redis)
                config["unknown"] = f"CONFIG GET refused ({exc})"
            configs.append(config)
        return configs

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        refuse_transaction(transaction)
        args = self.layout.complete_args(record, state, response, now, expires_at)
        if not await self._fenced("complete", record, args):
            raise LeaseLost(
                "the claim on this Idempotency-Key was taken over or swept before completion"
            )

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        refuse_transaction(transaction)
        return await self._fenced("release", record, self.layout.release_args(record, now))

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        refuse_transaction(transaction)
        args = self.layout.checkpoint_args(record, recovery_point, now)
        if not await self._fenced("checkpoint", record, args):
            raise LeaseLost("the claim on this Idempotency-Key was taken over or swept")

    async def get(self, principal: str, key: str) -> Record | None:
        with translated():
            flat = await self.client.hgetall(self.layout.record_key(principal, key))
        return record_from_reply(flat)

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` records untouched since ``cutoff`` stale, bucket by bucket."""
        index = swept_index(from_state)
        args = self.layout.sweep_args(from_state, cutoff, now, keep_until, new_lease_token())
        marked: list[Record] = []

        async def mark(bucket: int, members: list[bytes]) -> int:
            reply = await self._evalsha("sweep", (*self.layout.indexes(bucket), *members), args)
            marked.extend(record_from_hash(flat) for flat in reply)
            return len(reply)

        await self._walk(index, now, cutoff, limit, mark)
        return marked

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        """Seconds until :meth:`sweep` with ``cutoff`` would mark a record (math.inf: none).

        The oldest entry of every bucket's index, in pipelined round trips of
        :data:`PROBE_CHUNK` buckets: the walk an idle sweep makes, without its marks.
        """
        index = swept_index(from_state)
        argv = [ms(now), ms(cutoff)]
        soonest = math.inf
        with translated():
            for chunk in self.layout.walk():
                for reply in await self._ask_each("due", chunk, index, argv):
                    if reply is not None:
                        soonest = min(soonest, int(reply) / 1000)
        return soonest

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        refuse_transaction(transaction)
        args = self.layout.settle_stale_args(record, state, response, now, expires_at)
        return await self._fenced("settle_stale", record, args)

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        refuse_transaction(transaction)
        args = self.layout.release_stale_args(record, now, forget_progress)
        return await self._fenced("release_stale", record, args)

    async def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` settled or released records past retention.

        Counts the expiry entries whose record Redis already deleted by TTL too.
        """
        args = [ms(now)]

        async def delete(bucket: int, members: list[bytes]) -> int:
            keys = (*self.layout.indexes(bucket), *members)
            return int(await self._evalsha("purge", keys, args))

        return await self._walk(EXPIRES, now, now, limit, delete)

    async def migrate(self) -> None:
        """Nothing to create; loads the scripts (on every master of a cluster), the boot first."""
        with translated():
            await self._prepare(ms(time.time()))

    async def close(self) -> None:
        await self.client.aclose()

    async def _walk(
        self,
        index: int,
        now: float,
        bound: float,
        limit: int,
        act: Callable[[int, list[bytes]], Awaitable[int]],
    ) -> int:
        """Probe every bucket's ``index`` for entries due by ``bound``; ``act`` on them.

        Stops once ``act`` has handled ``limit``; returns how many it handled.
        """
        done = 0
        with translated():
            for chunk in self.layout.walk():
                probed = await self._probe(chunk, probe_args(index, now, bound, limit - done))
                for bucket, members in zip(chunk, probed, strict=True):
                    if members:
                        done += await act(bucket, members[: limit - done])
                        if done >= limit:
                            return done
        return done

    async def _probe(self, chunk: Sequence[int], args: tuple[int, list[Any]]) -> list[Any]:
        """One pipelined round trip: the probe script on each bucket (on its own node)."""
        return await self._ask_each("probe", chunk, *args)

    async def _ask_each(
        self, script: str, chunk: Sequence[int], index: int, argv: list[Any]
    ) -> list[Any]:
        """One pipelined round trip: a one-key script on one index of each bucket.

        A connection the server had closed while it sat idle (a node restarted,
        its ``timeout``, ``CLIENT KILL``) fails the round trip: redis.asyncio's
        cluster client lends one unchecked (its single-server pool checks), and
        a client told not to retry gives up on it. Failing, it drops that
        connection and marks its node's other idle ones; the walk only reads, so
        it is asked again, up to :data:`WALK_ATTEMPTS` times in all (the node's
        pool, then the one the client asks for the topology, may each hold one).
        A server that is gone fails every attempt; a timeout is not repeated.
        """
        attempts = 1
        while True:
            try:
                return await self._ask_each_once(script, chunk, index, argv)
            except Exception as exc:
                if attempts == WALK_ATTEMPTS or not is_connection_lost(exc):
                    raise
                attempts += 1

    async def _ask_each_once(
        self, script: str, chunk: Sequence[int], index: int, argv: list[Any]
    ) -> list[Any]:
        if self._cluster:
            await self._learn_slots()  # _each names each command's node
        try:
            return list(await self._each(script, chunk, index, argv).execute())
        except self._no_script:  # SCRIPT FLUSH or a restart: the boot, the scripts, once more
            await self._prepare(argv[0])
            return list(await self._each(script, chunk, index, argv).execute())

    def _each(self, script: str, chunk: Sequence[int], index: int, argv: list[Any]) -> Any:
        pipe = self.client.pipeline(transaction=False)
        for bucket in chunk:
            # execute_command: redis-py's cluster pipeline refuses its evalsha()
            # method, yet routes the command itself by its one key (one slot).
            name = self.layout.indexes(bucket)[index]
            pipe.execute_command("EVALSHA", self._shas[script], 1, name, *argv, **self._route(name))
        return pipe

    def _route(self, key: bytes) -> dict[str, Any]:
        """A pipelined one-key script's node, named (on a cluster, once its slots are known).

        Left to find it, redis-py's sync cluster pipeline (8.x) first asks a node
        ``COMMAND GETKEYS``, one round trip per command: a walk of the 1024 buckets
        took 1024 of them. A MOVED reply is still followed.
        """
        return {"target_nodes": self.client.get_node_from_key(key)} if self._cluster else {}

    async def _learn_slots(self) -> None:
        """redis.asyncio's cluster client learns its slots lazily: before a key's node is
        looked up (at once when known; the sync client learns them when it is made)."""
        initialize = getattr(self.client, "initialize", None)
        if initialize is not None:
            await initialize()

    async def _fenced(self, script: str, record: Record, args: list[Any]) -> bool:
        keys = self.layout.keys(record.principal, record.key)
        try:
            return bool(await self._evalsha(script, keys, args))
        except Exception as exc:
            raise_unavailable(exc)
            raise

    async def _evalsha(self, script: str, keys: Sequence[bytes], args: list[Any]) -> Any:
        """One round trip; a server that lost its script cache is sent the text once."""
        sha = self._shas[script]
        try:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        except self._no_script:  # SCRIPT FLUSH or a restart: the boot, the scripts, once more
            await self._prepare(args[0])
            return await self.client.evalsha(sha, len(keys), *keys, *args)
