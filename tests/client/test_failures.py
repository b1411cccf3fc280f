"""
What each library's errors mean to the policy: sent or not, retried or not.

The exceptions are the libraries' own, built as they raise them (no network):
the real faults behind them are exercised against the demo in
``test_demo_client.py`` (refused, dropped, cut short, timed out).
"""

from __future__ import annotations

import ssl

import httpx
import pytest
import requests.exceptions
from urllib3.connection import HTTPConnection
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError

from idemflow.client._httpx import failure_of as httpx_failure
from idemflow.client._requests import failure_of as requests_failure
from idemflow.client._retry import Failure

HTTPX = [
    (httpx.ConnectError("refused"), Failure.CONNECT),
    (httpx.ConnectTimeout("slow"), Failure.CONNECT),
    (httpx.PoolTimeout("busy"), Failure.CONNECT),
    (httpx.ReadTimeout("late"), Failure.TIMEOUT),
    (httpx.WriteTimeout("late"), Failure.TIMEOUT),
    (httpx.ReadError("reset"), Failure.DISCONNECTED),
    (httpx.WriteError("broken pipe"), Failure.DISCONNECTED),
    (httpx.RemoteProtocolError("server disconnected"), Failure.DISCONNECTED),
    (httpx.UnsupportedProtocol("ftp"), Failure.FATAL),
    (httpx.LocalProtocolError("bad header"), Failure.FATAL),
    (httpx.ProxyError("407"), Failure.FATAL),
]


@pytest.mark.parametrize(("error", "failure"), HTTPX, ids=[type(e).__name__ for e, _ in HTTPX])
def test_httpx_errors(error: httpx.TransportError, failure: Failure) -> None:
    assert httpx_failure(error) is failure


def test_a_tls_failure_is_never_retried() -> None:
    """httpx reports a bad certificate as a ConnectError; its cause says it is TLS."""
    error = httpx.ConnectError("certificate verify failed")
    error.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
    assert httpx_failure(error) is Failure.FATAL


def refused() -> MaxRetryError:
    connection = HTTPConnection("127.0.0.1", 9)
    return MaxRetryError(None, "/", NewConnectionError(connection, "refused"))  # type: ignore[arg-type]


REQUESTS = [
    (requests.exceptions.ConnectionError(refused()), Failure.CONNECT),
    (requests.exceptions.ConnectTimeout("slow"), Failure.CONNECT),
    (requests.exceptions.ReadTimeout("late"), Failure.TIMEOUT),
    (requests.exceptions.ConnectionError(ProtocolError("reset")), Failure.DISCONNECTED),
    (requests.exceptions.ChunkedEncodingError("cut short"), Failure.DISCONNECTED),
    (requests.exceptions.SSLError("certificate verify failed"), Failure.FATAL),
    (requests.exceptions.ProxyError("407"), Failure.FATAL),
    (requests.exceptions.ContentDecodingError("bad gzip"), Failure.FATAL),
    (requests.exceptions.InvalidURL("nope"), Failure.FATAL),
]


@pytest.mark.parametrize(
    ("error", "failure"),
    REQUESTS,
    ids=[type(e).__name__ + str(i) for i, (e, _) in enumerate(REQUESTS)],
)
def test_requests_errors(error: requests.exceptions.RequestException, failure: Failure) -> None:
    assert requests_failure(error) is failure
