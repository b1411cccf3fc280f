"""
The client's keys: made once per operation, written the way the server reads them,
and never sent with a second request.

The bugs this prevents are client-side: a key regenerated on every retry
(each retry is a new operation to the server, so a lost answer charges twice),
a caller's key overwritten by the library, and one key sent with two different
bodies (the server answers 422, after the first has taken effect). So a key is
chosen before the first attempt, the caller's ``Idempotency-Key`` is kept
verbatim, and every key this client sent is remembered with a fingerprint of
what it was sent with: a second, different request under it is refused here,
before anything is sent (`KeyReusedLocally`).
"""

from __future__ import annotations

import enum
import hashlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote, urljoin, urlsplit

from .._errors import InvalidKey, KeyReused
from .._identity import parse_key

__all__ = [
    "HEADER",
    "KeyFactory",
    "KeyForm",
    "KeyLedger",
    "KeyReusedLocally",
    "Redirect",
    "SentKey",
    "encode_key",
    "request_fingerprint",
    "uuid4_key",
]

HEADER = "Idempotency-Key"

#: Makes a new key: any callable returning 1 to 255 printable ASCII characters.
KeyFactory = Callable[[], str]

# How much of a key an error message may quote (keys can be long; logs should not be).
_EXCERPT = 40

#: The statuses httpx and requests follow (with a ``Location``).
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}

_V = TypeVar("_V")


class KeyForm(enum.Enum):
    """How a generated key is written in the header.

    ``BARE`` (the default, as Stripe and most servers expect): ``Idempotency-Key: 3f2a…``.
    ``SF_STRING``: the RFC 9651 String the IETF draft specifies, ``Idempotency-Key: "3f2a…"``.
    idemflow's server reads both as the same key; a strict draft server needs the second.
    """

    BARE = "bare"
    SF_STRING = "sf-string"


def uuid4_key() -> str:
    """The default key: a random UUIDv4, 36 characters (122 random bits)."""
    return str(uuid.uuid4())


def encode_key(key: str, form: KeyForm) -> str:
    """The header value for ``key``; raises `idemflow.InvalidKey` if the server would.

    Checked with the server's own parser ([`idemflow.parse_key`][idemflow.parse_key]), so a key
    this client sends is a key an idemflow server accepts, and means the same
    key: 1 to 255 printable ASCII characters, and in the bare form none of
    ``, ; "``, space or tab (write those keys as ``KeyForm.SF_STRING``).
    """
    if form is KeyForm.SF_STRING:
        value = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        value = key
    # The server parses exactly this; a mismatch means the value would be read differently.
    parse_key([value], strict=form is KeyForm.SF_STRING)
    return value


def excerpt(key: str) -> str:
    """A key as an error message may show it: short, ``repr``-escaped."""
    return repr(key[:_EXCERPT]) + ("..." if len(key) > _EXCERPT else "")


class KeyReusedLocally(KeyReused):
    """This client already sent the key with a different request: refused before sending.

    The server would answer 422 (its fingerprint differs), but only after the
    first request took effect; refusing here keeps the mistake out of the
    network. Use a new key for a new request.
    """


def request_fingerprint(method: str, url: str, body: bytes) -> str:
    """What a key is sent with: method, full URL (query included) and the body, byte for byte.

    Stricter than the server's (which canonicalises JSON): the client cannot
    know which differences a server ignores, so it refuses any.
    """
    digest = hashlib.sha256()
    for part in (method.upper().encode(), url.encode("utf-8", "surrogatepass"), body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def scope_of(url: str, headers: Mapping[str, str]) -> str:
    """Whose key it is, as the server sees it: the origin, and a digest of the credentials.

    Servers scope keys to a principal (idemflow does), so the same key sent by
    two users is two keys; the ``Authorization`` header stands for the
    principal (hashed: the ledger never holds a secret).
    """
    parts = urlsplit(url)
    credentials = headers.get("authorization") or ""
    digest = hashlib.sha256(credentials.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{parts.scheme}://{parts.netloc} {digest}"


@dataclass(frozen=True, slots=True)
class Followed:
    """The request a client following a redirect sends: its method and absolute URL."""

    method: str
    url: str


@dataclass(frozen=True, slots=True)
class Redirect:
    """A redirect answered to a request sent with ``key``: what the library may send next."""

    scope: str
    key: str
    method: str
    url: str
    body: bytes
    status: int
    location: str

    def followed(self) -> Followed:
        """What httpx and requests both send: ``303`` (and ``302``) turn into ``GET``
        (a ``HEAD`` stays one), ``301`` turns a ``POST`` into ``GET``, ``307``/``308``
        keep the method (and the body)."""
        method = self.method.upper()
        if (self.status in (302, 303) and method != "HEAD") or (
            self.status == 301 and method == "POST"
        ):
            method = "GET"
        return Followed(method, urljoin(self.url, self.location.strip()))


def _origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port: two URLs differing in any of them are two origins."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port that is no number: no origin shares it
        return (scheme, parts.netloc.lower(), -1)
    return (scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme))


def _comparable(url: str) -> str:
    """A URL as two libraries may both write it: origin, path and query, unescaped."""
    parts = urlsplit(url)
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}{unquote(parts.path) or '/'}?{unquote(parts.query)}"


@dataclass(frozen=True, slots=True)
class SentKey:
    """The key one operation sends: its value, and whether the caller chose it."""

    key: str
    #: The header value to add, or None when the caller's own header is kept as is.
    header_value: str | None

    @property
    def generated(self) -> bool:
        return self.header_value is not None


class KeyLedger:
    """Every key this client sent lately, with what it was sent with (bounded, thread-safe).

    ``capacity`` keys are remembered, the least recently used forgotten first:
    a caller reusing a key after that many others escapes the local check, and
    meets the server's 422.
    """

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            msg = "the key ledger's capacity must be at least 1"
            raise ValueError(msg)
        self._capacity = capacity
        #: (scope, key) -> the fingerprints of the requests it may be sent with: one, and
        #: each same-origin, same-method redirect of it.
        self._sent: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
        #: (key, URL) a redirect pointed to where following it must not carry the key.
        self._stays: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sent)

    def choose(
        self,
        values: Sequence[str],
        factory: KeyFactory,
        form: KeyForm,
        *,
        scope: str,
        fingerprint: str,
    ) -> SentKey:
        """The operation's key: the caller's (``values``, its header lines) or a new one.

        Raises:
            idemflow.InvalidKey: the caller's header, or the factory's key, is malformed.
            KeyReusedLocally: the key was sent before with a different request.
        """
        if values:
            sent = SentKey(parse_key(values), None)
        else:
            key = factory()
            sent = SentKey(key, encode_key(key, form))
        self._remember(scope, sent.key, fingerprint)
        return sent

    def redirected(self, redirect: Redirect) -> None:
        """An answer to a request sent with ``redirect.key`` redirects; the library may follow.

        A redirect that keeps the method and the origin (a ``307``/``308`` to the same
        server) asks for the same request elsewhere: the same operation, so the request
        that follows may carry the key (accepted here with its new URL). Any other (the
        method turned into ``GET``, another origin) makes a request that is not the
        operation, or goes to a server the key was not meant for: remembered, so that
        `stays_behind` drops the key from the request that follows.
        """
        try:
            follows = redirect.followed()
            same_origin = _origin(follows.url) == _origin(redirect.url)
            target = _comparable(follows.url)
        except ValueError:  # a Location no URL parser reads: no library follows it
            return
        if same_origin and follows.method == redirect.method.upper():
            fingerprint = request_fingerprint(follows.method, follows.url, redirect.body)
            with self._lock:
                known = self._sent.get((redirect.scope, redirect.key), frozenset())
                self._keep(self._sent, (redirect.scope, redirect.key), known | {fingerprint})
            return
        with self._lock:
            self._keep(self._stays, (redirect.key, target), None)

    def stays_behind(self, values: Sequence[str], url: str) -> bool:
        """Does this request (its ``Idempotency-Key`` lines, its URL) follow a redirect the
        key must not follow (`redirected`)? Never raises: any method, any header."""
        if not values:
            return False
        try:
            key = parse_key(values)
            target = _comparable(url)
        except (InvalidKey, ValueError):  # not a key this client sent, or not a URL it sent to
            return False
        with self._lock:
            return (key, target) in self._stays

    def _remember(self, scope: str, key: str, fingerprint: str) -> None:
        with self._lock:
            known = self._sent.get((scope, key))
            if known is not None and fingerprint not in known:
                msg = (
                    f"Idempotency-Key {excerpt(key)} was already sent by this client with a "
                    "different request (method, URL or body); use a new key for a new request"
                )
                raise KeyReusedLocally(msg)
            self._keep(self._sent, (scope, key), known or frozenset({fingerprint}))

    def _keep(
        self, memory: OrderedDict[tuple[str, str], _V], at: tuple[str, str], value: _V
    ) -> None:
        """Store ``value``, most recently used, forgetting the oldest past the capacity."""
        memory[at] = value
        memory.move_to_end(at)
        while len(memory) > self._capacity:
            memory.popitem(last=False)
