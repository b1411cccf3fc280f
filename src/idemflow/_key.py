"""
Reading the ``Idempotency-Key`` request header.

The IETF draft makes the field an RFC 9651 *String* (``"8e03978e-..."``); almost
every client sends it bare (Stripe's ``Idempotency-Key: KG5LxwFBepaKHyUD``), so the
bare form is accepted unless ``strict=True``: ``"abc"`` and ``abc`` are one key.
It is bounded before anything else sees it (1 to `MAX_KEY_LENGTH` printable
ASCII), and errors quote at most a short ``repr``-escaped excerpt of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._errors import InvalidKey, MissingKey

__all__ = ["MAX_KEY_LENGTH", "excerpt", "parse_key"]

#: The longest key accepted, in characters (Stripe's limit).
MAX_KEY_LENGTH = 255

# Optional whitespace around a field value (RFC 9110 §5.6.3).
_OWS = " \t"

# Every character escaped plus two quotes: anything longer is refused before a loop.
_MAX_RAW_LENGTH = 2 * MAX_KEY_LENGTH + 2

# How much of the client's value an error message may quote.
_EXCERPT_LENGTH = 40

# Names for the characters clients most often get wrong.
_CHAR_NAMES = {"\t": "a tab", " ": "a space", "\x7f": "DEL"}


def parse_key(values: Sequence[str], *, strict: bool = False) -> str:
    """The key carried by every ``Idempotency-Key`` field line (latin-1; ``[]`` when
    absent): MissingKey without one, InvalidKey for anything but one valid key
    (``strict``: quoted only, as the draft requires)."""
    # A bare str is a Sequence[str] too: it would be "sent 36 times".
    if isinstance(values, str):
        raise TypeError("values must be a sequence of field lines, not a str")
    if not values:
        raise MissingKey("the Idempotency-Key header is required")
    if len(values) > 1:
        # Repeated lines combine into a list (RFC 9110 §5.3), never a valid Item.
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
        # Other characters are checked once, on the decoded key.
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
    """Refuse what a bare key cannot hold (``;`` starts parameters, refused as quoted,
    so both forms agree); the rest is checked with the key."""
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
    """Return ``key`` if it is 1 to MAX_KEY_LENGTH printable ASCII characters."""
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
