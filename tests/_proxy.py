"""
A loopback TCP proxy that loses one answer: the request reaches the server, its reply never returns.

This is the fault a retry protocol cannot see from the client: the statement
ran (and, autocommitted, committed) on the server, and the client only knows
that its connection died. The proxy relays bytes both ways until a chunk from
the client matches ``cut_after``; it relays that chunk, and when the server's
reply arrives (so the statement ran) it drops it and closes both sides.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class _Pair:
    """One client connection and the server connection it is relayed to."""

    client: socket.socket
    server: socket.socket
    #: Set before the matching request is relayed: its reply must not be.
    cutting: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class LosingProxy:
    """Relays 127.0.0.1:``port`` to ``target``; loses the reply to the first matching request."""

    def __init__(self, target: tuple[str, int], cut_after: Callable[[bytes], bool]) -> None:
        self.target = target
        self.cut_after = cut_after
        #: Set once a reply was lost (the statement ran); no later request is cut.
        self.lost = threading.Event()
        self._armed = threading.Lock()  # held by the one request that is cut
        self._pairs: list[_Pair] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # the proxy was closed
                return
            pair = _Pair(client, socket.create_connection(self.target))
            self._pairs.append(pair)
            threading.Thread(target=self._upstream, args=(pair,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(pair,), daemon=True).start()

    def _upstream(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while chunk := pair.client.recv(65536):
                if self.cut_after(chunk) and self._armed.acquire(blocking=False):
                    pair.cutting.set()
                pair.server.sendall(chunk)
        pair.close()

    def _downstream(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while chunk := pair.server.recv(65536):
                if pair.cutting.is_set():
                    self.lost.set()
                    break
                pair.client.sendall(chunk)
        pair.close()

    def close(self) -> None:
        self._listener.close()
        for pair in self._pairs:
            pair.close()


@contextlib.contextmanager
def losing_proxy(
    target: tuple[str, int], cut_after: Callable[[bytes], bool]
) -> Iterator[LosingProxy]:
    """A :class:`LosingProxy`, closed with every connection it relays on exit."""
    proxy = LosingProxy(target, cut_after)
    try:
        yield proxy
    finally:
        proxy.close()
