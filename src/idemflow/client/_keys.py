"""The client's keys: made once per operation, written the way the server reads them, and
never sent with a second request (docs/client.md, "The key rules")."""

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

HEADER = "Idempotency-Key"
_EXCERPT = 40  # keys can be long; error messages should not be

#: Makes a new key: any callable returning 1 to 255 printable ASCII characters.
KeyFactory = Callable[[], str]

#: The statuses httpx and requests follow (with a ``Location``).
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}

_V = TypeVar("_V")


class KeyForm(enum.Enum):
    """How a generated key is written: ``BARE`` (``3f2a…``) or ``SF_STRING`` (``"3f2a…"``)."""

    BARE = "bare"
    SF_STRING = "sf-string"


def uuid4_key() -> str:
    """The default key: a random UUIDv4, 36 characters (122 random bits)."""
    return str(uuid.uuid4())


def encode_key(key: str, form: KeyForm) -> str:
    """The header value for ``key``; `idemflow.InvalidKey` where the server's parser would."""
    if form is KeyForm.SF_STRING:
        value = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        value = key
    parse_key([value], strict=form is KeyForm.SF_STRING)
    return value


def excerpt(key: str) -> str:
    return repr(key[:_EXCERPT]) + ("..." if len(key) > _EXCERPT else "")


class KeyReusedLocally(KeyReused):
    """This client already sent the key with a different request: refused before sending."""


def request_fingerprint(method: str, url: str, body: bytes) -> str:
    """Method, full URL and body, byte for byte: stricter than any server's."""
    digest = hashlib.sha256()
    for part in (method.upper().encode(), url.encode("utf-8", "surrogatepass"), body):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def scope_of(url: str, headers: Mapping[str, str]) -> str:
    """Whose key it is: the origin, and a digest of ``Authorization`` (the principal)."""
    parts = urlsplit(url)
    credentials = headers.get("authorization") or ""
    digest = hashlib.sha256(credentials.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{parts.scheme}://{parts.netloc} {digest}"


@dataclass(frozen=True, slots=True)
class Followed:
    """The request a client following a redirect sends."""

    method: str
    url: str


@dataclass(frozen=True, slots=True)
class Redirect:
    """A redirect answered to a request sent with ``key``."""

    scope: str
    key: str
    method: str
    url: str
    body: bytes
    status: int
    location: str

    def followed(self) -> Followed:
        """What httpx and requests both send next (``303`` turns into ``GET``, …)."""
        method = self.method.upper()
        if (self.status in (302, 303) and method != "HEAD") or (
            self.status == 301 and method == "POST"
        ):
            method = "GET"
        return Followed(method, urljoin(self.url, self.location.strip()))


def _origin(url: str) -> tuple[str, str, int | None]:
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
    """The key one operation sends; ``header_value`` None: the caller's header is kept."""

    key: str
    header_value: str | None

    @property
    def generated(self) -> bool:
        return self.header_value is not None


class KeyLedger:
    """The last ``capacity`` keys this client sent, with what they were sent with."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            msg = "the key ledger's capacity must be at least 1"
            raise ValueError(msg)
        self._capacity = capacity
        #: (scope, key) -> the requests it may be sent with: one, and its same-origin redirects.
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
        """The caller's key (``values``) or a new one; InvalidKey, KeyReusedLocally."""
        if values:
            sent = SentKey(parse_key(values), None)
        else:
            key = factory()
            sent = SentKey(key, encode_key(key, form))
        self._remember(scope, sent.key, fingerprint)
        return sent

    def redirected(self, redirect: Redirect) -> None:
        """The key follows a same-origin ``307``/``308``; any other redirect leaves it behind."""
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
        """Does this request follow a redirect its key must not follow? Never raises."""
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
        memory[at] = value
        memory.move_to_end(at)
        while len(memory) > self._capacity:
            memory.popitem(last=False)
