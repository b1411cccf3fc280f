"""
A broken network between the demo and its database, made in the storm's own process.

The storm's other fault is a SIGKILL of the service; once the key store sits
across a network, the failures are partitions, delay and loss mid-statement
(a COMMIT whose reply never arrives). This machine's kernel has no ``netem``
queueing discipline (``tc qdisc … netem`` is refused), so the link is a
loopback TCP relay the storm starts and breaks on purpose:

- **partition**: from that moment nothing crosses, in either direction; bytes
  sent meanwhile are lost, and every connection that lost bytes (or was
  opened during the partition) is reset when the link heals, as a TCP
  connection whose retransmissions time out. A statement sent just before
  the partition ran on the server and its reply is lost: the request cannot
  know whether its claim, checkpoint or COMMIT happened.
- **delay**: every chunk waits ``delay ± jitter`` before it is passed on
  (per direction, in order).
- **loss**: TCP hides a lost segment behind a retransmission, so loss is
  seen as a stall: a chunk waits one retransmission timeout (200–600 ms)
  more, with probability ``stall_rate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

__all__ = ["FaultyLink", "LinkFaults"]

#: Linux's minimum retransmission timeout, and the longest stall a lost segment costs here.
RTO_SECONDS = (0.2, 0.6)


@dataclass(frozen=True, slots=True)
class LinkFaults:
    """What the link does to every chunk while it is up. Milliseconds, and a probability."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    stall_rate: float = 0.0

    def wait(self, rng: random.Random) -> float:
        """Seconds one chunk waits before it is passed on."""
        seconds = max(0.0, self.delay_ms + rng.uniform(-self.jitter_ms, self.jitter_ms)) / 1000
        if self.stall_rate and rng.random() < self.stall_rate:
            seconds += rng.uniform(*RTO_SECONDS)
        return seconds


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    #: Lost bytes during a partition: reset when the link heals.
    doomed: bool = False
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for writer in (self.client, self.server):
            if writer is not None:
                writer.transport.abort()


class FaultyLink:
    """A relay on 127.0.0.1 to ``target`` that the storm partitions, delays and heals."""

    def __init__(self, target: tuple[str, int], faults: LinkFaults, rng: random.Random) -> None:
        self.target = target
        self.faults = faults
        self.rng = rng
        self.partitions = 0
        #: Connections reset when a partition healed.
        self.resets = 0
        self._up = asyncio.Event()
        self._up.set()
        self._connections: set[_Connection] = set()
        #: The tasks serving connections: stop() waits for them, so none is
        #: left for the event loop to cancel (and log) when it closes.
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @classmethod
    def for_url(cls, url: str, faults: LinkFaults, rng: random.Random) -> FaultyLink:
        """A link to the server ``url`` names (its scheme's port if it names none)."""
        from .config import default_port

        return cls((urlsplit(url).hostname or "127.0.0.1", default_port(url)), faults, rng)

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by the link's."""
        parts = urlsplit(url)
        user = f"{parts.username}{':' + parts.password if parts.password else ''}@"
        netloc = f"{user if parts.username else ''}127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.reset()
        self._up.set()
        if self._handlers:  # their transports are aborted: each ends at once
            await asyncio.wait(list(self._handlers), timeout=5.0)
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def partitioned(self) -> bool:
        return not self._up.is_set()

    def partition(self) -> None:
        """From now on nothing crosses the link."""
        if self._up.is_set():
            self.partitions += 1
            self._up.clear()

    def heal(self) -> None:
        """Bytes cross again; every connection that lost some is reset (its TCP timed out)."""
        for connection in [c for c in self._connections if c.doomed]:
            self.resets += 1
            connection.reset()
        self._up.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        self._connections.add(connection)
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            if self.partitioned:  # the SYN is lost: the connection dies with the partition
                connection.doomed = True
                await self._up.wait()
                return
            upstream_reader, connection.server = await asyncio.open_connection(*self.target)
            await asyncio.gather(
                self._pump(connection, reader, connection.server),
                self._pump(connection, upstream_reader, writer),
            )
        except OSError:
            pass
        finally:
            self._connections.discard(connection)
            connection.reset()

    async def _pump(
        self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                if self.partitioned or connection.doomed:
                    connection.doomed = True  # lost: the peer's retransmissions will time out
                    continue
                if wait := self.faults.wait(self.rng):
                    await asyncio.sleep(wait)
                if self.partitioned or connection.doomed:  # the partition began meanwhile
                    connection.doomed = True
                    continue
                writer.write(chunk)
                await writer.drain()
        connection.reset()
