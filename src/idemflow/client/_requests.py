"""A ``requests`` adapter that keys and retries unsafe requests: a thin loop around the
sans-I/O `Operation`. Its ``max_retries`` stays 0: the retries are the policy's."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias, cast

import requests
import requests.adapters
import requests.exceptions
from urllib3.exceptions import NewConnectionError

from ._keys import HEADER, KeyLedger
from ._retry import OUTCOME_ATTRIBUTE, Failure, Observer, Operation, Operations, RetryPolicy

Timeout: TypeAlias = float | tuple[float, float] | tuple[float, None] | None


def failure_of(error: requests.exceptions.RequestException) -> Failure:
    """What a requests error says about the request."""
    if isinstance(error, requests.exceptions.SSLError | requests.exceptions.ProxyError):
        return Failure.FATAL
    if isinstance(error, requests.exceptions.ConnectTimeout) or _never_connected(error):
        return Failure.CONNECT
    if isinstance(error, requests.exceptions.ReadTimeout):
        return Failure.TIMEOUT
    if isinstance(
        error, requests.exceptions.ConnectionError | requests.exceptions.ChunkedEncodingError
    ):
        return Failure.DISCONNECTED
    return Failure.FATAL


class IdempotentAdapter(requests.adapters.HTTPAdapter):
    """Gives each unsafe request one key and retries it safely (see `idemflow.client`).

    Args:
        policy: which methods, what is retried, the deadline, the keys.
        ledger: the keys sent and what with.
        on_attempt: called after every attempt with an ``AttemptReport``.
        sleep: waits between attempts (injected in tests).
        **kwargs: `requests.adapters.HTTPAdapter`'s (pool sizes, …).
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        ledger: KeyLedger | None = None,
        on_attempt: Observer | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._operations = Operations(policy, ledger, on_attempt)
        self._sleep = sleep

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: Timeout = None,
        verify: bool | str = True,
        cert: bytes | str | tuple[bytes | str, bytes | str] | None = None,
        proxies: Mapping[str, str] | None = None,
    ) -> requests.Response:
        caller = request.headers.get(HEADER)
        if caller is not None and self._operations.ledger.stays_behind([caller], request.url or ""):
            del request.headers[HEADER]  # a redirect the key must not follow
        if not self._operations.policy.manages(request.method or ""):
            return super().send(request, stream, timeout, verify, cert, proxies)
        operation = self._start(request)
        while True:
            attempt_timeout = _capped(operation, timeout)
            try:
                response = super().send(request, stream, attempt_timeout, verify, cert, proxies)
                body = response.content  # read here, so an answer cut short is retried
            except requests.exceptions.RequestException as error:
                decision = operation.failed(failure_of(error), error)
                if not decision.retry:
                    raise
            else:
                decision = operation.answered(response.status_code, response.headers, body)
                if not decision.retry:
                    setattr(response, OUTCOME_ATTRIBUTE, operation.outcome())
                    return response
                response.close()
            self._sleep(decision.delay)

    def _start(self, request: requests.PreparedRequest) -> Operation:
        """Read the body once (a stream cannot be sent twice), choose the key, add its header."""
        body = _body_bytes(request)
        caller, method, url = request.headers.get(HEADER), request.method or "", request.url or ""
        keys = [] if caller is None else [caller]
        operation = self._operations.start(method, url, request.headers, keys, body)
        if operation.sent.header_value is not None:
            request.headers[HEADER] = operation.sent.header_value
        return operation


def idempotent_session(
    policy: RetryPolicy | None = None,
    *,
    ledger: KeyLedger | None = None,
    on_attempt: Observer | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> requests.Session:
    """A ``requests.Session`` whose http:// and https:// requests go through one adapter."""
    session = requests.Session()
    adapter = IdempotentAdapter(policy, ledger=ledger, on_attempt=on_attempt, sleep=sleep)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _body_bytes(request: requests.PreparedRequest) -> bytes:
    """The body as the bytes every attempt sends (a generator or file read into them)."""
    body: Any = request.body
    if body is None:
        return b""
    if isinstance(body, str):
        body = body.encode("utf-8")
    elif not isinstance(body, bytes):
        chunks = body.read() if hasattr(body, "read") else b"".join(cast(Iterable[bytes], body))
        body = chunks.encode("utf-8") if isinstance(chunks, str) else bytes(chunks)
        request.headers.pop("Transfer-Encoding", None)
        request.headers["Content-Length"] = str(len(body))
    request.body = body
    return cast(bytes, body)


def _capped(operation: Operation, timeout: Timeout) -> Timeout:
    if isinstance(timeout, tuple):
        connect, read = timeout
        return (cast(float, operation.cap(connect)), cast(float, operation.cap(read)))
    return operation.cap(timeout)


def _never_connected(error: BaseException) -> bool:
    """requests wraps a refused connection in ConnectionError(MaxRetryError(NewConnectionError))."""
    reason = getattr(error.args[0], "reason", None) if error.args else None
    return isinstance(reason, NewConnectionError)
