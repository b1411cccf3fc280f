"""httpx transports, sync and async, that key and retry unsafe requests: thin loops around
the sans-I/O `Operation` (``httpx.Client(transport=IdempotentTransport())``)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx

from ._keys import HEADER, KeyLedger
from ._retry import (
    OUTCOME,
    Deadline,
    Failure,
    Observer,
    Operation,
    Operations,
    RetryPolicy,
)

#: A request's own deadline: ``client.post(url, extensions={DEADLINE: 5.0})``.
DEADLINE = "idemflow.deadline"

_LOST = (httpx.ReadError, httpx.WriteError, httpx.CloseError, httpx.RemoteProtocolError)
_FAILURES: tuple[tuple[tuple[type[httpx.TransportError], ...], Failure], ...] = (
    ((httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout), Failure.CONNECT),
    ((httpx.ReadTimeout, httpx.WriteTimeout), Failure.TIMEOUT),
    (_LOST, Failure.DISCONNECTED),
)


def failure_of(error: httpx.TransportError) -> Failure:
    """What an httpx error says about the request; a TLS failure is never retried."""
    if _caused_by_tls(error):
        return Failure.FATAL
    for kind, failure in _FAILURES:
        if isinstance(error, kind):
            return failure
    return Failure.FATAL


class _Keyed:
    def __init__(
        self, policy: RetryPolicy | None, ledger: KeyLedger | None, observer: Observer | None
    ) -> None:
        self.operations = Operations(policy, ledger, observer)

    def manages(self, request: httpx.Request) -> bool:
        """Is it the policy's? Drops a key a redirect must not carry (httpx copies headers)."""
        if self.operations.ledger.stays_behind(request.headers.get_list(HEADER), str(request.url)):
            del request.headers[HEADER]
        return self.operations.policy.manages(request.method)

    def start(self, request: httpx.Request, body: bytes) -> tuple[Operation, dict[str, Any]]:
        """Choose the key, add its header; return the caller's timeouts."""
        deadline: Deadline | None = request.extensions.get(DEADLINE)
        method, url, keys = request.method, str(request.url), request.headers.get_list(HEADER)
        operation = self.operations.start(method, url, request.headers, keys, body, deadline)
        if operation.sent.header_value is not None:
            request.headers[HEADER] = operation.sent.header_value
        timeouts: dict[str, Any] = dict(request.extensions.get("timeout") or {})
        return operation, timeouts

    @staticmethod
    def arm(request: httpx.Request, operation: Operation, timeouts: Mapping[str, Any]) -> None:
        """This attempt's timeouts: the caller's, cut to the time left."""
        names = timeouts or dict.fromkeys(("connect", "read", "write", "pool"))
        capped = {name: operation.cap(value) for name, value in names.items()}
        request.extensions = {**request.extensions, "timeout": capped}

    @staticmethod
    def finish(operation: Operation, response: httpx.Response, body: bytes) -> httpx.Response:
        """The final answer, read whole, with the operation's outcome."""
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx.ByteStream(body),
            extensions={**response.extensions, OUTCOME: operation.outcome()},
        )


class IdempotentTransport(httpx.BaseTransport):
    """Gives each unsafe request one key and retries it safely (see `idemflow.client`).

    Args:
        wrapped: the transport that sends (``httpx.HTTPTransport()`` by default).
        policy: which methods, what is retried, the deadline, the keys.
        ledger: the keys sent and what with; share one between transports.
        on_attempt: called after every attempt with an `AttemptReport`.
        sleep: waits between attempts (injected in tests).
    """

    def __init__(
        self,
        wrapped: httpx.BaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        ledger: KeyLedger | None = None,
        on_attempt: Observer | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._wrapped = wrapped or httpx.HTTPTransport()
        self._keyed = _Keyed(policy, ledger, on_attempt)
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self._keyed.manages(request):
            return self._wrapped.handle_request(request)
        operation, timeouts = self._keyed.start(request, request.read())
        while True:
            self._keyed.arm(request, operation, timeouts)
            try:
                response = self._wrapped.handle_request(request)
                body = _read(response)  # inside: an answer cut short is retried
            except httpx.TransportError as error:
                decision = operation.failed(failure_of(error), error)
                if not decision.retry:
                    raise
            else:
                decision = operation.answered(response.status_code, response.headers, body)
                if not decision.retry:
                    return self._keyed.finish(operation, response, body)
            self._sleep(decision.delay)

    def close(self) -> None:
        self._wrapped.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """The async twin of `IdempotentTransport`; sleeps with anyio (asyncio or trio)."""

    def __init__(
        self,
        wrapped: httpx.AsyncBaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        ledger: KeyLedger | None = None,
        on_attempt: Observer | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self._wrapped = wrapped or httpx.AsyncHTTPTransport()
        self._keyed = _Keyed(policy, ledger, on_attempt)
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._keyed.manages(request):
            return await self._wrapped.handle_async_request(request)
        operation, timeouts = self._keyed.start(request, await request.aread())
        while True:
            self._keyed.arm(request, operation, timeouts)
            try:
                response = await self._wrapped.handle_async_request(request)
                body = await _aread(response)
            except httpx.TransportError as error:
                decision = operation.failed(failure_of(error), error)
                if not decision.retry:
                    raise
            else:
                decision = operation.answered(response.status_code, response.headers, body)
                if not decision.retry:
                    return self._keyed.finish(operation, response, body)
            await self._sleep(decision.delay)

    async def aclose(self) -> None:
        await self._wrapped.aclose()


def _read(response: httpx.Response) -> bytes:
    """The answer's bytes as sent (still encoded): the client decodes them later."""
    try:
        return b"".join(response.iter_raw())
    finally:
        response.close()


async def _aread(response: httpx.Response) -> bytes:
    try:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


def _caused_by_tls(error: BaseException) -> bool:
    seen: BaseException | None = error
    for _ in range(16):  # a chain is short; a cycle must not hang us
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
