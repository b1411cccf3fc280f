"""
Strict JSON in, RFC 8785 canonical JSON (JCS) out.

A fingerprint must not change when a client re-serialises the same request
with other whitespace, another key order or other number spellings, so JSON
bodies are hashed in canonical form: `parse_json` reads I-JSON
(RFC 7493) strictly (anything it refuses raises [`InvalidBody`][idemflow.InvalidBody];
nesting is capped at `MAX_DEPTH` levels) and `canonical_json`
writes RFC 8785, with one deliberate deviation: a Python ``int`` keeps its
exact digits above 2**53. What strict means, the canonical form, and the
deviation and its price: docs/core.md, "Fingerprints".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ._errors import InvalidBody
from ._key import excerpt

__all__ = ["MAX_DEPTH", "canonical_json", "canonical_json_bytes", "parse_json"]

#: The deepest nesting a body may have: beyond any real request, below the recursion limit.
MAX_DEPTH = 128


def parse_json(data: bytes) -> Any:
    """Parse ``data`` as strict I-JSON; InvalidBody says why it is not."""
    return _parse(data)[0]


def _parse(data: bytes) -> tuple[Any, bool]:
    """`parse_json`, and whether the value is *plain* (see `_check_tree`)."""
    text = _decode(data)
    value = _loads(text)
    return value, _check_tree(value, escaped="\\u" in text, ascii=text.isascii())


def _decode(data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidBody(
            f"request body is not valid UTF-8 (bad byte at offset {e.start})"
        ) from None
    if text.startswith("\ufeff"):
        # RFC 8259 §8.1 lets parsers skip a BOM; a strict one refuses to guess.
        raise InvalidBody("request body starts with a byte order mark (U+FEFF)")
    return text


def _loads(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as e:
        # e.msg and the position never quote the body.
        raise InvalidBody(
            f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:
        # The C scanner recurses per level: 100 000 "[" must be a 400, not a 500.
        raise _too_deep() from None


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Build an object, refusing repeated names (compared after unescaping)."""
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
    # json reads 1e400 as inf, which neither I-JSON nor JCS can hold.
    value = float(text)
    if not math.isfinite(value):
        raise InvalidBody("request body contains a number too large for a double")
    return value


def _bounded_int(text: str) -> int:
    # int() refuses more than sys.get_int_max_str_digits(): a 400, not a 500.
    try:
        return int(text)
    except ValueError:
        raise InvalidBody(
            f"request body contains an integer with {len(text)} digits, too many to read"
        ) from None


# Made once (json.loads with hooks builds one per call); it keeps no state between calls.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_members,
    parse_constant=_reject_constant,
    parse_float=_finite_float,
    parse_int=_bounded_int,
)

_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_tree(value: Any, *, escaped: bool = True, ascii: bool = False) -> bool:
    """Refuse lone surrogates (only an unpaired ``\\u`` escape leaves one) and nesting
    beyond MAX_DEPTH, iteratively; True if *plain*: no float and no astral member name,
    where ``json.dumps`` (sorted, compact) writes exactly RFC 8785 and is faster."""
    astral = escaped or not ascii
    plain = True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if escaped:
                _check_text(item)
        elif isinstance(item, float):
            plain = False
        elif isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise _too_deep()
            if isinstance(item, dict):
                for name in item:
                    if escaped:
                        _check_text(name)
                    if plain and astral and not name.isascii() and _ASTRAL.search(name):
                        plain = False
                item = item.values()
            stack.extend((child, depth + 1) for child in item)
    return plain


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
    parts: list[str] = []
    _write(value, parts.append)
    return "".join(parts).encode("utf-8")


def _write(value: Any, out: Callable[[str], object]) -> None:
    # bool before int: True is an int too.
    if value is None:
        out("null")
    elif value is True:
        out("true")
    elif value is False:
        out("false")
    elif isinstance(value, str):
        out(_string(value))
    elif isinstance(value, int):
        out(int.__repr__(value))
    elif isinstance(value, float):
        out(_number(value))
    elif isinstance(value, Mapping):
        _write_object(value, out)
    elif isinstance(value, list | tuple):
        _write_array(value, out)
    else:
        raise TypeError(f"cannot canonicalise a {type(value).__name__} as JSON")


def _write_object(obj: Mapping[Any, Any], out: Callable[[str], object]) -> None:
    for name in obj:
        if not isinstance(name, str):
            raise TypeError(f"JSON member names must be str, not {type(name).__name__}")
    out("{")
    for i, name in enumerate(sorted(obj, key=_utf16_order)):
        if i:
            out(",")
        out(_string(name))
        out(":")
        _write(obj[name], out)
    out("}")


def _write_array(items: list[Any] | tuple[Any, ...], out: Callable[[str], object]) -> None:
    out("[")
    for i, item in enumerate(items):
        if i:
            out(",")
        _write(item, out)
    out("]")


def _utf16_order(name: str) -> bytes:
    # RFC 8785 §3.2.3 sorts by UTF-16 code units (not code points past U+E000);
    # big-endian bytes compare like the code units.
    return name.encode("utf-16-be", "surrogatepass")


# JSON.stringify escapes only these (and other controls as \u00xx).
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
_NEEDS_ESCAPE = re.compile('["\\\\\x00-\x1f]')


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _ESCAPES.get(ch) or f"\\u{ord(ch):04x}"


def _string(text: str) -> str:
    if _SURROGATE.search(text):
        raise ValueError("cannot canonicalise a str containing a lone surrogate")
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'


def _number(value: float) -> str:
    """Format a double as ECMAScript's ``Number.prototype.toString`` does."""
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
    """Parse ``data`` strictly (InvalidBody) and return its canonical form, leaving out
    ``exclude_fields``: ``"a.b"`` is member ``b`` of object ``a`` (objects only, never
    arrays; a missing path is ignored)."""
    # A lone str is a Collection[str] of its characters: "id" would drop "i" and "d".
    if isinstance(exclude_fields, str):
        raise TypeError("exclude_fields must be a collection of names, not a str")
    value, plain = _parse(data)
    for path in exclude_fields:
        _drop(value, path.split("."))
    if plain:  # the same bytes, from the C encoder (see _check_tree)
        return _PLAIN.encode(value).encode("utf-8")
    return canonical_json(value)


_PLAIN = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), check_circular=False
)


def _drop(value: Any, path: list[str]) -> None:
    """Remove the member at ``path`` from ``value`` in place, if it is there."""
    *parents, name = path
    for segment in parents:
        if not isinstance(value, dict):
            return
        value = value.get(segment)
    if isinstance(value, dict):
        value.pop(name, None)
