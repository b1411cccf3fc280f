"""
A recording relay: what the client really put on the wire, seen between it and the server.

A TCP relay on a free loopback port in a thread of its own. It forwards bytes
both ways untouched and, on the way in, parses each HTTP/1.1 request
(``Content-Length`` framing: the client under test always sends it) to record
its method, path, ``Idempotency-Key`` lines and body. It is not a server and
answers nothing itself: when the server behind it dies, it closes the
client's connection, so the client sees the drop the server caused; while the
server is down, every connection it accepts is closed at once.

:meth:`RecordingRelay.cut_answers` makes it a fault on the wire too: the next
answers are cut off a few bytes into their body, as a connection lost on the
way back would, after the server did its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Recorded", "RecordingRelay", "recording_relay"]

#: A request head is never this long in these tests; past it the stream is not HTTP.
MAX_HEAD = 64 * 1024
#: How much of a cut answer's body still gets through.
CUT_AFTER = 5


@dataclass(frozen=True, slots=True)
class Recorded:
    """One request as it arrived."""

    method: str
    path: str
    keys: tuple[str, ...]
    body: bytes


class RecordingRelay:
    """Relays 127.0.0.1:``port`` to ``upstream`` and records every request passing through."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = 0
        self._requests: list[Recorded] = []
        #: What could not be parsed: a test reading ``requests()`` fails on it.
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._cuts = 0
        #: Answers cut so far.
        self.cut = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, path: str | None = None) -> list[Recorded]:
        with self._lock:
            assert not self._errors, self._errors
            return [r for r in self._requests if path is None or r.path == path]

    def cut_answers(self, count: int) -> None:
        """Cut the answers on the next ``count`` connections short, mid-body."""
        with self._lock:
            self._cuts = count

    def _take_cut(self) -> bool:
        with self._lock:
            if self._cuts <= 0:
                return False
            self._cuts -= 1
            self.cut += 1
            return True

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("the recording relay did not start")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            # Connections still open end with the relay (no task outlives its loop).
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    async def _relay(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        try:
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:  # the server is down: drop the client, as a dead server would
            client_out.close()
            return
        inbound = asyncio.ensure_future(self._pump(client_in, server_out, record=True))
        back = self._cut_short if self._take_cut() else self._pump
        outbound = asyncio.ensure_future(back(server_in, client_out, record=False))
        try:
            await asyncio.wait([inbound, outbound], return_when=asyncio.FIRST_COMPLETED)
        finally:  # one side closed (or the relay stops): close the other
            for task in (inbound, outbound):
                task.cancel()
            for writer in (client_out, server_out):
                writer.close()
            await asyncio.gather(inbound, outbound, return_exceptions=True)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, record: bool
    ) -> None:
        buffer = b""
        with contextlib.suppress(OSError):
            while chunk := await source.read(65536):
                if record:
                    try:
                        buffer = self._record(buffer + chunk)
                    except (AssertionError, ValueError) as exc:
                        with self._lock:
                            self._errors.append(f"{type(exc).__name__}: {exc}")
                        buffer = b""
                sink.write(chunk)
                await sink.drain()

    async def _cut_short(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, record: bool
    ) -> None:
        """Forward the answer's head and CUT_AFTER bytes of its body, then hang up."""
        buffer = b""
        with contextlib.suppress(OSError):
            while (end := buffer.find(b"\r\n\r\n")) < 0 or len(buffer) < end + 4 + CUT_AFTER:
                chunk = await source.read(65536)
                if not chunk:
                    break
                buffer += chunk
            end = buffer.find(b"\r\n\r\n")
            sink.write(buffer[: end + 4 + CUT_AFTER] if end >= 0 else buffer)
            await sink.drain()

    def _record(self, buffer: bytes) -> bytes:
        """Record every whole request in ``buffer``; return what is left of the next one."""
        while (end := buffer.find(b"\r\n\r\n")) >= 0:
            head = buffer[:end].decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            fields = [line.split(":", 1) for line in head[1:]]
            headers = [(name.strip().lower(), value.strip()) for name, value in fields]
            assert ("transfer-encoding", "chunked") not in headers, "expected Content-Length"
            length = int(dict(headers).get("content-length", "0"))
            if len(buffer) < end + 4 + length:
                return buffer
            body = buffer[end + 4 : end + 4 + length]
            keys = tuple(value for name, value in headers if name == "idempotency-key")
            with self._lock:
                self._requests.append(Recorded(method, path, keys, body))
            buffer = buffer[end + 4 + length :]
        assert len(buffer) < MAX_HEAD, "a request head without an end"
        return buffer


@contextlib.contextmanager
def recording_relay(upstream: int) -> Iterator[RecordingRelay]:
    relay = RecordingRelay(upstream)
    relay.start()
    try:
        yield relay
    finally:
        relay.stop()
