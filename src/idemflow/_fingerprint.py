"""
The request fingerprint: what makes "same key, different request" detectable.

A fingerprint is a SHA-256 digest over the method, the route, the query
string (if any, in canonical form) and the body (JSON in RFC 8785 canonical
form, other bodies as sent). Only the digest leaves this module: the body is
never stored or logged. The hashed message is unambiguous (a version tag,
length-prefixed method and route, the body kind, the body). See
docs/core.md, "Fingerprints", and docs/http.md, "The fingerprint".
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection
from urllib.parse import quote_from_bytes, unquote_to_bytes

from ._canonical import canonical_json_bytes
from ._errors import BodyTooLarge

__all__ = ["DEFAULT_MAX_BODY_BYTES", "canonical_query", "fingerprint"]

#: Bodies larger than this (1 MiB) are refused rather than hashed.
DEFAULT_MAX_BODY_BYTES = 1_048_576

# Bump the tag whenever the encoding below changes: a stored fingerprint must
# never match one computed differently.
_VERSION_TAG = b"idemflow-fp-v1\n"


def fingerprint(
    method: str,
    route: str,
    body: bytes,
    *,
    content_type: str | None = None,
    exclude_fields: Collection[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    query: str | bytes = b"",
) -> str:
    """Return ``"sha256:<hex>"`` identifying this request's intent.

    Args:
        method: The HTTP method; case does not matter.
        route: The route the request matched, e.g. ``/payments``.
        body: The raw request body.
        content_type: The ``Content-Type`` header, if any.  JSON media types
            are fingerprinted by their canonical form.
        exclude_fields: JSON member names (or dotted paths) to leave out, such
            as a per-attempt timestamp; see
            :func:`~idemflow._canonical.canonical_json_bytes`.  Ignored for
            non-JSON bodies.
        max_body_bytes: The largest body that may be fingerprinted.
        query: The raw query string (``a=1&b=2``, without ``?``); see
            :func:`canonical_query`.

    Raises:
        InvalidBody: The body is declared as JSON and is not strict I-JSON
            (:class:`~idemflow.BodyTooLarge`: it is over ``max_body_bytes``).
    """
    # Checked here too: a raw body would otherwise ignore the mistake silently
    # until the first JSON request.
    if isinstance(exclude_fields, str):
        raise TypeError("exclude_fields must be a collection of names, not a str")
    if len(body) > max_body_bytes:
        raise BodyTooLarge(
            f"request body is {len(body)} bytes; "
            f"the limit for idempotent requests is {max_body_bytes} bytes"
        )
    kind, hashed_body = _hashed_body(body, content_type, exclude_fields)

    digest = _head(method, route).copy()
    canonical = canonical_query(query) if query else b""
    if canonical:
        # "query" can never be a body kind ("json", "raw"), so a digest with a
        # query cannot collide with one without.
        digest.update(b"query\n" + b"%d:%s\n" % (len(canonical), canonical))
    digest.update(kind + b"\n")
    # The body is last, so it needs no length: it runs to the end.
    digest.update(hashed_body)
    return "sha256:" + digest.hexdigest()


def _hashed_body(
    body: bytes, content_type: str | None, exclude_fields: Collection[str]
) -> tuple[bytes, bytes]:
    """The body kind and the bytes that stand for the body in the digest."""
    if not _is_json(content_type):
        return b"raw", body
    if not body:
        # An empty body is no JSON document, but a bodyless POST declared as
        # JSON is common and harmless.  Canonical JSON is never empty, so this
        # cannot collide with a real document.
        return b"json", b""
    return b"json", canonical_json_bytes(body, exclude_fields)


@functools.lru_cache(maxsize=1024)
def _head(method: str, route: str) -> hashlib._Hash:
    """The digest of what comes before the query and the body, hashed once per route."""
    digest = hashlib.sha256(_VERSION_TAG)
    digest.update(_length_prefixed(method.upper()))
    digest.update(_length_prefixed(route))
    return digest


@functools.lru_cache(maxsize=256)
def _is_json(content_type: str | None) -> bool:
    """Whether the media type is ``application/json`` or a ``+json`` suffix type."""
    if content_type is None:
        return False
    media_type = content_type.partition(";")[0].strip(" \t").lower()
    type_, _, subtype = media_type.partition("/")
    return (type_ == "application" and subtype == "json") or (
        bool(type_) and subtype.endswith("+json")
    )


def _length_prefixed(text: str) -> bytes:
    # surrogatepass: an ASGI path may carry any code point; every str must map
    # to distinct bytes rather than raise.
    data = text.encode("utf-8", "surrogatepass")
    return b"%d:%s\n" % (len(data), data)


def canonical_query(query: str | bytes) -> bytes:
    """``query`` with its pairs percent-decoded, sorted and re-encoded: one spelling per meaning.

    ``b=2&a=1``, ``a=1&b=2`` and ``a=%31&b=2`` are one query; ``a`` and ``a=``
    are one pair; empty pieces (``a=1&&b=2``) are dropped. A str is taken as
    latin-1, as ASGI servers decode bytes they pass on.
    """
    raw = query.encode("latin-1", "replace") if isinstance(query, str) else query
    raw = raw.removeprefix(b"?")
    if not raw:
        return b""
    pairs = sorted(
        (_unquote(name), _unquote(value))
        for name, _, value in (piece.partition(b"=") for piece in raw.split(b"&") if piece)
    )
    return b"&".join(_quote(name) + b"=" + _quote(value) for name, value in pairs)


def _unquote(part: bytes) -> bytes:
    return unquote_to_bytes(part.replace(b"+", b" "))


def _quote(part: bytes) -> bytes:
    return quote_from_bytes(part, safe="").encode("ascii")
