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
before anything is sent (:class:`KeyReusedLocally`).
"""

from __future__ import annotations

import enum
import hashlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from .._errors import KeyReused
from .._key import parse_key

__all__ = [
    "HEADER",
    "KeyFactory",
    "KeyForm",
    "KeyLedger",
    "KeyReusedLocally",
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
    """The header value for ``key``; raises :class:`idemflow.InvalidKey` if the server would.

    Checked with the server's own parser (:func:`idemflow.parse_key`), so a key
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

    __module__ = "idemflow.client"


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
        self._sent: OrderedDict[tuple[str, str], str] = OrderedDict()
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

    def _remember(self, scope: str, key: str, fingerprint: str) -> None:
        with self._lock:
            known = self._sent.get((scope, key))
            if known is not None and known != fingerprint:
                msg = (
                    f"Idempotency-Key {excerpt(key)} was already sent by this client with a "
                    "different request (method, URL or body); use a new key for a new request"
                )
                raise KeyReusedLocally(msg)
            self._sent[(scope, key)] = fingerprint
            self._sent.move_to_end((scope, key))
            while len(self._sent) > self._capacity:
                self._sent.popitem(last=False)
