"""What identifies a request: its ``Idempotency-Key`` (an RFC 9651 *String*, or bare) and
its fingerprint (SHA-256 over the request, a JSON body strict I-JSON in RFC 8785 form).
Why and how: docs/core.md, "Fingerprints" and "Keys"."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any
from urllib.parse import quote_from_bytes, unquote_to_bytes

from ._errors import BodyTooLarge, InvalidBody, InvalidKey, MissingKey

#: The longest key accepted, in characters (Stripe's limit).
MAX_KEY_LENGTH = 255
_OWS = " \t"  # RFC 9110 §5.6.3
# Every character escaped plus two quotes: anything longer is refused before a loop.
_MAX_RAW_LENGTH = 2 * MAX_KEY_LENGTH + 2
_EXCERPT_LENGTH = 40
_CHAR_NAMES = {"\t": "a tab", " ": "a space", "\x7f": "DEL"}


def parse_key(values: Sequence[str], *, strict: bool = False) -> str:
    """The key of the ``Idempotency-Key`` field lines (``[]`` when absent): MissingKey, or
    InvalidKey for anything but one valid key (``strict``: quoted only, as the draft asks)."""
    # A bare str is a Sequence[str] too: it would be "sent 36 times".
    if isinstance(values, str):
        raise TypeError("values must be a sequence of field lines, not a str")
    if not values:
        raise MissingKey("the Idempotency-Key header is required")
    if len(values) > 1:  # a list (RFC 9110 §5.3), never a valid Item
        raise InvalidKey(f"Idempotency-Key was sent {len(values)} times; send exactly one")

    raw = values[0].strip(_OWS)
    if not raw:
        raise InvalidKey("Idempotency-Key is empty")
    if len(raw) > _MAX_RAW_LENGTH:
        raise _too_long()
    if raw.startswith('"'):
        key = _unquote(raw)
    elif strict:
        raise InvalidKey('Idempotency-Key must be a quoted string (RFC 9651), e.g. "order-42"')
    else:
        key = _check_bare(raw)
    return _check_key(key)


def _unquote(raw: str) -> str:
    """Decode an sf-string that starts at ``raw[0]`` and must end at ``raw[-1]``."""
    if raw.find('"', 1) == len(raw) - 1 and "\\" not in raw:
        return raw[1:-1]  # the usual key: no escape, nothing after the closing quote
    chars: list[str] = []
    i = 1
    while i < len(raw):
        ch = raw[i]
        if ch == '"':
            _reject_trailing(raw[i + 1 :])
            return "".join(chars)
        if ch == "\\":
            escaped = raw[i + 1 : i + 2]
            if not escaped:
                break  # a backslash at the very end: the quote is missing
            if escaped not in ('"', "\\"):
                raise InvalidKey(
                    'Idempotency-Key: only \\" and \\\\ escapes are allowed in a quoted key'
                )
            ch = escaped
            i += 1
        chars.append(ch)
        i += 1
    raise InvalidKey("Idempotency-Key: the quoted key has no closing quote")


def _reject_trailing(rest: str) -> None:
    """Refuse anything after the closing quote: parameters, list members, junk."""
    if not rest:
        return
    tail = rest.lstrip(_OWS)
    if tail.startswith(","):
        raise InvalidKey("Idempotency-Key: lists are not allowed; send one key")
    if tail.startswith(";"):
        raise InvalidKey("Idempotency-Key: parameters are not allowed")
    raise InvalidKey(
        "Idempotency-Key: unexpected characters after the closing quote: " + excerpt(rest)
    )


def _check_bare(raw: str) -> str:
    """Refuse what a bare key cannot hold (``;`` starts parameters: refused as quoted)."""
    if "," in raw:
        raise InvalidKey("Idempotency-Key: lists are not allowed; send one key")
    if ";" in raw:
        raise InvalidKey(
            "Idempotency-Key: parameters are not allowed; a key containing ';' must be "
            'sent quoted, e.g. "a;b"'
        )
    if '"' in raw:
        raise InvalidKey(
            "Idempotency-Key: a bare key may not contain a double quote; "
            'use the quoted form with \\" instead'
        )
    for ch in _OWS:
        if ch in raw:
            raise InvalidKey(
                f"Idempotency-Key: a bare key may not contain {_CHAR_NAMES[ch]}; "
                "use the quoted form"
            )
    return raw


def _check_key(key: str) -> str:
    """``key`` if it is 1 to MAX_KEY_LENGTH printable ASCII characters."""
    if not key:
        raise InvalidKey("Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise _too_long()
    if key.isascii() and key.isprintable():  # printable ASCII is exactly 0x20-0x7E
        return key
    for ch in key:
        if not " " <= ch <= "~":
            raise InvalidKey(
                f"Idempotency-Key contains {_describe(ch)}; "
                "only printable ASCII (0x20-0x7E) is allowed"
            )
    return key


def _too_long() -> InvalidKey:
    return InvalidKey(f"Idempotency-Key is longer than {MAX_KEY_LENGTH} characters")


def _describe(ch: str) -> str:
    """Name a character without writing it raw into a message (or a log line)."""
    code = f"U+{ord(ch):04X}"
    name = _CHAR_NAMES.get(ch)
    if name is None:
        name = "a control character" if ord(ch) < 0x20 else "a non-ASCII character"
    return f"{name} ({code})"


def excerpt(text: str) -> str:
    """At most _EXCERPT_LENGTH characters of client input, escaped by ``repr``."""
    if len(text) <= _EXCERPT_LENGTH:
        return repr(text)
    return repr(text[:_EXCERPT_LENGTH]) + "..."


#: The deepest nesting a body may have: beyond any real request, below the recursion limit.
MAX_DEPTH = 128


def parse_json(data: bytes) -> Any:
    """Parse ``data`` as strict I-JSON; InvalidBody says why it is not."""
    return _parse(data)[0]


def _parse(data: bytes) -> tuple[Any, bool]:
    """`parse_json`, and whether the value is *plain* (see `_check_tree`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidBody(
            f"request body is not valid UTF-8 (bad byte at offset {e.start})"
        ) from None
    if text.startswith("\ufeff"):  # RFC 8259 §8.1 lets parsers skip it; strict ones refuse
        raise InvalidBody("request body starts with a byte order mark (U+FEFF)")
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as e:  # e.msg and the position never quote the body
        raise InvalidBody(
            f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:  # the C scanner recurses per level: a 400, not a 500
        raise _too_deep() from None
    return value, _check_tree(value, escaped="\\u" in text, ascii=text.isascii())


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object; InvalidBody for repeated names (compared after unescaping)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise InvalidBody(f"request body repeats the member name {excerpt(name)}")
            seen.add(name)
    return obj


def _reject_constant(name: str) -> Any:
    raise InvalidBody(f"request body contains {name}, which is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)  # 1e400 reads as inf, which neither I-JSON nor JCS can hold
    if not math.isfinite(value):
        raise InvalidBody("request body contains a number too large for a double")
    return value


def _bounded_int(text: str) -> int:
    try:  # more than sys.get_int_max_str_digits(): a 400, not a 500
        return int(text)
    except ValueError:
        raise InvalidBody(
            f"request body contains an integer with {len(text)} digits, too many to read"
        ) from None


# Made once: json.loads with hooks builds one per call.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_members,
    parse_constant=_reject_constant,
    parse_float=_finite_float,
    parse_int=_bounded_int,
)

_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_tree(value: Any, *, escaped: bool = True, ascii: bool = False) -> bool:
    """Refuse lone surrogates and nesting beyond MAX_DEPTH; True if *plain* (no float, no
    astral member name): ``json.dumps`` then writes exactly RFC 8785, faster."""
    astral = escaped or not ascii
    plain = True
    # Leaves are checked where they are met; only containers go on the stack.
    stack: list[tuple[Any, int]] = []
    items: Any = (value,)
    depth = 0
    while True:
        for item in items:
            if isinstance(item, str):
                if escaped:
                    _check_text(item)
            elif isinstance(item, float):
                plain = False
            elif isinstance(item, dict | list):
                if depth >= MAX_DEPTH:
                    raise _too_deep()
                stack.append((item, depth + 1))
        if not stack:
            return plain
        items, depth = stack.pop()
        if isinstance(items, dict):
            for name in items if astral else ():  # ASCII text without escapes: nothing to see
                if escaped:
                    _check_text(name)
                if plain and not name.isascii() and _ASTRAL.search(name):
                    plain = False
            items = items.values()


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def _check_text(text: str) -> None:
    if _SURROGATE.search(text):
        raise InvalidBody(
            "request body contains an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF)"
        )


def _too_deep() -> InvalidBody:
    return InvalidBody(f"request body nests deeper than {MAX_DEPTH} levels")


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` (JSON types, tuples as arrays; ints exact) as RFC 8785, UTF-8.
    TypeError for another type; ValueError for a non-finite float or a lone surrogate."""
    return _write(value).encode("utf-8")


_LITERALS = {None: "null", True: "true", False: "false"}


def _write(value: Any) -> str:
    if value is None or value is True or value is False:  # before int: True is an int too
        return _LITERALS[value]
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str):
                raise TypeError(f"JSON member names must be str, not {type(name).__name__}")
        members = sorted(value, key=_utf16_order)
        return "{" + ",".join(f"{_string(name)}:{_write(value[name])}" for name in members) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_write(item) for item in value) + "]"
    raise TypeError(f"cannot canonicalise a {type(value).__name__} as JSON")


def _utf16_order(name: str) -> bytes:
    # RFC 8785 §3.2.3 sorts by UTF-16 code units; big-endian bytes compare like them.
    return name.encode("utf-16-be", "surrogatepass")


def _string(text: str) -> str:
    if _SURROGATE.search(text):
        raise ValueError("cannot canonicalise a str containing a lone surrogate")
    return encode_basestring(text)  # escapes what JSON.stringify does, as RFC 8785 asks


def _number(value: float) -> str:
    """A double as ECMAScript's ``Number.prototype.toString`` writes it."""
    if not math.isfinite(value):
        raise ValueError(f"cannot canonicalise {value!r}: JSON has no such number")
    if value == 0:
        return "0"  # also -0.0
    # repr() gives the shortest round-tripping digits, as ECMAScript; only the layout differs.
    digits, point = _decimal_digits(float.__repr__(abs(value)))
    sign = "-" if value < 0 else ""
    return sign + _es_layout(digits, point)


def _decimal_digits(text: str) -> tuple[str, int]:
    """A positive float's repr as ``0.<digits> * 10**point`` (ECMAScript's *s* and *n*)."""
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).rstrip("0")
    point = len(whole) + int(exponent or 0)
    significant = digits.lstrip("0")
    return significant, point - (len(digits) - len(significant))


def _es_layout(digits: str, point: int) -> str:
    """Lay out ``0.<digits> * 10**point`` as ECMA-262's Number::toString does."""
    k = len(digits)
    if k <= point <= 21:
        return digits + "0" * (point - k)
    if 0 < point <= 21:
        return digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return "0." + "0" * -point + digits
    exponent = point - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{mantissa}e{'+' if exponent > 0 else '-'}{abs(exponent)}"


def canonical_json_bytes(data: bytes, exclude_fields: Collection[str] = ()) -> bytes:
    """``data`` parsed strictly (InvalidBody), in canonical form without ``exclude_fields``
    (``"a.b"``: member ``b`` of object ``a``; never into arrays; a missing path is ignored)."""
    if isinstance(exclude_fields, str):
        raise TypeError("exclude_fields must be a collection of names, not a str")
    value, plain = _parse(data)
    for path in exclude_fields:
        _drop(value, path.split("."))
    if plain:  # the same bytes, from the C encoder
        return _PLAIN.encode(value).encode("utf-8")
    return canonical_json(value)


_PLAIN = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), check_circular=False
)


def _drop(value: Any, path: list[str]) -> None:
    """Remove the member at ``path`` from ``value``, if it is there."""
    *parents, name = path
    for segment in parents:
        if not isinstance(value, dict):
            return
        value = value.get(segment)
    if isinstance(value, dict):
        value.pop(name, None)


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
    """``"sha256:<hex>"`` of the request, a JSON body canonical without ``exclude_fields``;
    InvalidBody for bad JSON, BodyTooLarge over ``max_body_bytes``."""
    # A lone str is a Collection[str] of its characters: "id" would drop "i" and "d".
    if isinstance(exclude_fields, str):
        raise TypeError("exclude_fields must be a collection of names, not a str")
    if len(body) > max_body_bytes:
        raise BodyTooLarge(
            f"request body is {len(body)} bytes; "
            f"the limit for idempotent requests is {max_body_bytes} bytes"
        )
    kind, hashed_body = b"raw", body
    if _is_json(content_type):
        # a bodyless POST declared JSON is common; canonical JSON is never empty
        kind, hashed_body = b"json", canonical_json_bytes(body, exclude_fields) if body else b""
    digest = _head(method, route).copy()
    canonical = canonical_query(query) if query else b""
    if canonical:  # "query" is never a body kind: no collision with a digest without one
        digest.update(b"query\n" + b"%d:%s\n" % (len(canonical), canonical))
    digest.update(kind + b"\n")
    digest.update(hashed_body)  # last, so it needs no length
    return "sha256:" + digest.hexdigest()


@functools.lru_cache(maxsize=1024)
def _head(method: str, route: str) -> hashlib._Hash:
    """The digest of what precedes the query and the body, once per route."""
    digest = hashlib.sha256(_VERSION_TAG)
    digest.update(_length_prefixed(method.upper()))
    digest.update(_length_prefixed(route))
    return digest


@functools.lru_cache(maxsize=256)
def _is_json(content_type: str | None) -> bool:
    """Is the media type ``application/json`` or a ``+json`` suffix type?"""
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
        (_unquote_part(name), _unquote_part(value))
        for name, _, value in (piece.partition(b"=") for piece in raw.split(b"&") if piece)
    )
    return b"&".join(_quote_part(name) + b"=" + _quote_part(value) for name, value in pairs)


def _unquote_part(part: bytes) -> bytes:
    return unquote_to_bytes(part.replace(b"+", b" "))


def _quote_part(part: bytes) -> bytes:
    return quote_from_bytes(part, safe="").encode("ascii")
