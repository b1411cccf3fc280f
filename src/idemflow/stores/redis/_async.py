"""The Redis store's I/O: each operation one script call (or a pipelined walk) of ``_scripts.py``.
This is the async source of truth; ``idemflow/stores/redis/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..._errors import LeaseLost
from ..._model import (
    DEFAULT_STALE_SECONDS,
    Claim,
    Intent,
    Record,
    Response,
    State,
    new_lease_token,
)
from ..protocol import AsyncMaintainableStore, AsyncTransaction
from ._scripts import (
    ARM_ABSENT,
    CREATE_ABSENT,
    EXPIRES,
    FIELDS,
    KEEP_ABSENT,
    LOST,
    WALK_ATTEMPTS,
    AsyncStartGate,
    RedisShared,
    is_connection_lost,
    ms,
    owner_args,
    probe_args,
    raise_unavailable,
    record_from_fields,
    refuse_transaction,
    refuse_volatile,
    settled_args,
    swept_index,
    translated,
    unpacked,
)
from ._stats import AsyncRedisObservable

__all__ = ["AsyncRedisStore"]


class AsyncRedisStore(RedisShared, AsyncRedisObservable, AsyncMaintainableStore):
    """Key records in Redis or Redis Cluster, on a redis-py client (``redis.asyncio``'s for async).

    Args:
        client: a redis-py client with ``decode_responses=False``, its retries bounded
            (``redis.asyncio.retry.Retry`` for the async one: given the sync one it never
            retries). Every script is safe to resend.
        policy: its stale threshold is how long claims are refused after a data loss is
            found; each driver made on the store tells it its own, the longest is kept.
        prefix: the start of every key this store writes.
        clock: ``"database"`` (Redis's ``TIME`` decides) or ``"caller"`` (frozen-clock tests).
        allow_volatile: accept a server with neither AOF nor RDB snapshots (refused by
            default: restarted, it forgets every claim).

    Cannot share a transaction; run the sweeper. The design: docs/stores.md, "Redis".
    """

    _gate_kind = AsyncStartGate

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        refuse_transaction(transaction)
        if not self._started:
            async with self._gate:  # the first claims of many callers: one starts the store
                if not self._started:
                    await self.start(now)
        args = self.layout.claim_args(
            intent, lease_token, now, expires_at, self.quarantine, stale_after
        )
        keys = self.layout.claim_keys(intent.principal, intent.key)
        reply = await self._evalsha("claim", keys, args)
        if reply.startswith(b"found"):  # its bucket's epoch gone: a loss takes every bucket
            with translated():  # of its server, so arm each one's quarantine from now
                await self._boot(ms(now), ARM_ABSENT)
        return self.layout.claimed(reply, intent, lease_token, now)

    async def start(self, now: float | None = None) -> None:
        """Refuse a volatile server (unless allowed), write every bucket's epoch, load the
        scripts. Run by the first claim; safe to run again."""
        at = ms(time.time() if now is None else now)
        with translated():
            if not self.allow_volatile:
                refuse_volatile(await self._persistence())
            await self._prepare(at, create=True)
        self._started = True

    async def _prepare(self, now_ms: int | bytes, *, create: bool = False) -> None:
        """The boot script on every epoch, then the scripts loaded: no claim runs on a boot
        its epochs were not told (one pipeline; on a cluster, the boot again after)."""
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

    async def _boot(self, now_ms: int | bytes, absent: str) -> None:
        """The boot script on every bucket's epoch; ``absent`` says what a missing one becomes."""
        epochs = self.layout.epoch_keys()
        argv = [now_ms, absent]
        if self._cluster:
            await self._boot_cluster(epochs, argv)
        else:
            await self.client.eval(self._boot_scripts["keys"], len(epochs), *epochs, *argv)

    async def _boot_cluster(self, epochs: list[bytes], argv: list[Any]) -> None:
        """The boot script once per master; where refused (Redis < 7, a moved slot), per bucket."""
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
        targets: list[Any] = list(self.client.get_primaries()) if self._cluster else [None]
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
        await self._fenced("complete", record, args, LOST + " before completion")

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        refuse_transaction(transaction)
        return await self._fenced("release", record, owner_args(record, now))

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        refuse_transaction(transaction)
        await self._fenced("checkpoint", record, owner_args(record, now, recovery_point), LOST)

    async def renew(self, record: Record, now: float) -> None:
        await self._fenced("renew", record, owner_args(record, now), LOST)

    async def get(self, principal: str, key: str) -> Record | None:
        with translated():
            fields = await self.client.hmget(self.layout.record_key(principal, key), FIELDS)
        return record_from_fields(fields)

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        index = swept_index(from_state)
        args = [ms(now), from_state.value, ms(cutoff), ms(keep_until), new_lease_token()]
        marked: list[Record] = []

        async def mark(bucket: int, members: list[bytes]) -> int:
            reply = await self._evalsha("sweep", (*self.layout.indexes(bucket), *members), args)
            marked.extend(unpacked(packed) for packed in reply)
            return len(reply)

        await self._walk(index, now, cutoff, limit, mark)
        return marked

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
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
        args = settled_args(record, state, response, now, expires_at, ms(record.updated_at))
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
        args = owner_args(record, now, ms(record.updated_at), "1" if forget_progress else "0")
        return await self._fenced("release_stale", record, args)

    async def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` records past retention (and count entries TTL emptied)."""
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
        """Probe every bucket's ``index`` for entries due by ``bound``; ``act`` on them, up to
        ``limit`` in all; returns how many it handled."""
        done = 0
        with translated():
            for chunk in self.layout.walk():
                args = probe_args(index, now, bound, limit - done)
                probed = await self._ask_each("probe", chunk, *args)
                for bucket, members in zip(chunk, probed, strict=True):
                    if members:
                        done += await act(bucket, members[: limit - done])
                        if done >= limit:
                            return done
        return done

    async def _ask_each(
        self, script: str, chunk: Sequence[int], index: int, argv: list[Any]
    ) -> list[Any]:
        """One pipelined round trip: a one-key script on one index of each bucket; asked again
        (it only reads) when a connection the server closed while idle fails it."""
        attempts = 1
        while True:
            try:
                if self._cluster:
                    await self._learn_slots()  # _each names each command's node
                try:
                    return list(await self._each(script, chunk, index, argv).execute())
                except self._no_script:  # SCRIPT FLUSH or a restart: the boot, the scripts again
                    await self._prepare(argv[0])
                    return list(await self._each(script, chunk, index, argv).execute())
            except Exception as exc:
                if attempts == WALK_ATTEMPTS or not is_connection_lost(exc):
                    raise
                attempts += 1

    async def _learn_slots(self) -> None:
        """redis.asyncio's cluster client learns its slots lazily: before a node lookup."""
        initialize = getattr(self.client, "initialize", None)
        if initialize is not None:
            await initialize()

    async def _fenced(self, script: str, record: Record, args: list[Any], lost: str = "") -> bool:
        """An owner's write, fenced: done, or refused (LeaseLost, if given its message)."""
        keys = self.layout.keys(record.principal, record.key)
        done = bool(await self._evalsha(script, keys, args))
        if lost and not done:
            raise LeaseLost(lost)
        return done

    async def _evalsha(self, script: str, keys: Sequence[bytes], args: list[Any]) -> Any:
        """One round trip, a failure a 503; a server that lost its scripts gets them again."""
        command = ("EVALSHA", self._shas[script], b"%d" % len(keys), *keys, *args)
        try:
            try:
                return await self.client.execute_command(*command)
            except self._no_script:
                await self._prepare(args[0])  # its first word: the caller's now
                return await self.client.execute_command(*command)
        except Exception as exc:
            raise_unavailable(exc)
            raise
