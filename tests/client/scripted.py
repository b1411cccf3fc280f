"""
A scripted HTTP server on 127.0.0.1: it answers what a test tells it, hostile answers included.

The demo answers as a well-behaved idemflow server does; the client must also
survive the ones that do not (a problem body nested 100 000 levels, broken
``Retry-After`` values, repeated headers) and follow redirects right. This
server, on a free port in a thread of its own, answers every request to a path
with the :class:`Answer` set for it (header lines sent verbatim, in order,
repeats included) and records each request as it arrived: method, path and its
``Idempotency-Key`` lines.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Answer", "Arrived", "ScriptedServer", "scripted_server"]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Sequence[tuple[str, str]] = ()
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Arrived:
    method: str
    path: str
    keys: tuple[str, ...]
    body: bytes


@dataclass
class ScriptedServer:
    answers: dict[str, Answer] = field(default_factory=dict)
    arrived: list[Arrived] = field(default_factory=list)
    port: int = 0

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self, path: str, answer: Answer) -> str:
        """Answer ``path`` with ``answer`` from now on; returns its URL."""
        self.answers[path] = answer
        return self.origin + path

    def requests(self, path: str | None = None) -> list[Arrived]:
        return [a for a in list(self.arrived) if path is None or a.path == path]


def _handler(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # the tests read what arrived, not stderr

        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            keys = tuple(self.headers.get_all("idempotency-key") or ())
            server.arrived.append(Arrived(self.command, self.path, keys, body))
            answer = server.answers.get(self.path, Answer(404))
            self.send_response(answer.status)
            for name, value in answer.headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

    return Handler


@contextlib.contextmanager
def scripted_server() -> Iterator[ScriptedServer]:
    """A :class:`ScriptedServer` listening on a free loopback port for the block."""
    server = ScriptedServer()
    http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    http.daemon_threads = True
    server.port = http.server_address[1]
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        http.shutdown()
        http.server_close()
        thread.join(10)
