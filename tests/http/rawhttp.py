"""
What the edge tests need beyond an HTTP client: HTTP/1.1 over a plain socket
for what a client library will not send (a body cut short by a disconnect, a
chunked body left unfinished, a ``Content-Length`` with no body behind it),
a wrapper that says when the app is done with a request, and the server's
error log.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

TIMEOUT = 30.0


class Finished:
    """Outermost ASGI wrapper: tells a test the app is done with its request (``X-Test-Id``).

    A request cut short leaves no trace when handled right; this is how a
    test knows it was handled at all before it looks.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._events: collections.defaultdict[str, threading.Event] = collections.defaultdict(
            threading.Event
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                test_id = dict(scope["headers"]).get(b"x-test-id")
                if test_id is not None:
                    self._events[test_id.decode()].set()

    def wait(self, test_id: str) -> bool:
        return self._events[test_id].wait(TIMEOUT)


class ErrorLog(logging.Handler):
    """Collects ERROR records of the server and of idemflow while a test runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self._logged = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._logged:
            self.records.append(record)
            self._logged.notify_all()

    def wait_for(self, fragment: str, timeout: float = 10) -> list[str]:
        """The texts once one holds ``fragment``, or at the timeout: a server logs an
        application's exception only after its 500 was sent, so after the client has it."""
        with self._logged:
            self._logged.wait_for(lambda: any(fragment in text for text in self.texts()), timeout)
        return self.texts()

    def texts(self) -> list[str]:
        return [
            record.getMessage() + (f" {record.exc_info[1]!r}" if record.exc_info else "")
            for record in self.records
        ]


@contextlib.contextmanager
def capture_errors() -> Iterator[ErrorLog]:
    """ERROR records of uvicorn, starlette and idemflow while the block runs.

    Attach after the server started: uvicorn's logging setup replaces the
    handlers of its own loggers.
    """
    handler = ErrorLog()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "idemflow", "starlette")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


@contextlib.contextmanager
def connection(url: str) -> Iterator[socket.socket]:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1", "loopback only"
    sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=TIMEOUT)
    try:
        yield sock
    finally:
        sock.close()


def head(
    method: str, path: str, headers: Mapping[str, str], *, length: int | None, chunked: bool
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def send_partial(
    url: str, path: str, headers: Mapping[str, str], declared: int, sent: bytes
) -> bytes:
    """Declare ``declared`` body bytes, send only ``sent``, and hang up.

    Returns whatever the server wrote before it closed the connection (it
    closes once it noticed the hang-up), so the caller knows the server saw it.
    """
    assert len(sent) < declared
    with connection(url) as sock:
        sock.sendall(head("POST", path, headers, length=declared, chunked=False) + sent)
        sock.shutdown(socket.SHUT_WR)  # the server sees the end of the stream mid-body
        return _read_to_eof(sock)


def post_declaring(url: str, path: str, headers: Mapping[str, str], length: int) -> RawResponse:
    """Send only the head of a request declaring ``length`` body bytes; read the answer."""
    with connection(url) as sock:
        sock.sendall(head("POST", path, headers, length=length, chunked=False))
        return read_response(sock)


def post_chunks(
    url: str, path: str, headers: Mapping[str, str], chunks: Iterable[bytes], *, finish: bool
) -> RawResponse:
    """Send a chunked body (its last chunk only if ``finish``); read the answer."""
    with connection(url) as sock:
        sock.sendall(head("POST", path, headers, length=None, chunked=True))
        for chunk in chunks:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        if finish:
            sock.sendall(b"0\r\n\r\n")
        return read_response(sock)


def read_response(sock: socket.socket) -> RawResponse:
    """One response: status line, headers, and a Content-Length or chunked body (or up to EOF)."""
    deadline = time.monotonic() + TIMEOUT
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, deadline)
    header_block, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = header_block.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return RawResponse(int(status_line.split(" ")[1]), headers, _dechunk(sock, body, deadline))
    length = int(headers.get("content-length", "-1"))
    while len(body) < length or length < 0:
        chunk = _recv(sock, deadline, eof_ok=length < 0)
        if not chunk:
            break
        body += chunk
    return RawResponse(int(status_line.split(" ")[1]), headers, body)


def _dechunk(sock: socket.socket, data: bytes, deadline: float) -> bytes:
    """A chunked body (its first bytes in ``data``), read to its last chunk, decoded."""
    body = b""
    while True:
        while b"\r\n" not in data:
            data += _recv(sock, deadline)
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(data) < size + 2:  # the chunk and its CRLF (the trailer's end after 0)
            data += _recv(sock, deadline)
        if size == 0:
            return body
        body, data = body + data[:size], data[size + 2 :]


def _recv(sock: socket.socket, deadline: float, *, eof_ok: bool = False) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    chunk = sock.recv(65536)
    if not chunk and not eof_ok:
        raise ConnectionError("the server closed the connection before answering")
    return chunk


def _read_to_eof(sock: socket.socket) -> bytes:
    deadline = time.monotonic() + TIMEOUT
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := _recv(sock, deadline, eof_ok=True):
            data += chunk
    return data
