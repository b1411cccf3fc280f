"""
The request fingerprint: what makes "same key, different request" detectable.

A SHA-256 digest over a version tag, the length-prefixed method and route, the
canonical query and the body (JSON in RFC 8785 form, others as sent): only the
digest leaves this module. See docs/core.md, "Fingerprints".
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

# Bump it when the encoding changes: a stored fingerprint must never match another's.
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
    """``"sha256:<hex>"`` for this request's intent: a JSON ``content_type``'s body in
    canonical form without ``exclude_fields`` (dotted paths); InvalidBody for bad JSON,
    BodyTooLarge over ``max_body_bytes``."""
    # Checked here too: a raw body would hide the mistake until the first JSON request.
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
        # "query" is never a body kind: a digest with a query cannot collide with one without.
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
        # A bodyless POST declared JSON is common; canonical JSON is never empty.
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
    # surrogatepass: an ASGI path may carry any code point, each mapped to distinct bytes.
    data = text.encode("utf-8", "surrogatepass")
    return b"%d:%s\n" % (len(data), data)


def canonical_query(query: str | bytes) -> bytes:
    """``query`` with its pairs percent-decoded, sorted and re-encoded: ``b=2&a=1`` and
    ``a=%31&b=2`` are one query, ``a`` and ``a=`` one pair; a str is taken as latin-1."""
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
