from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemflow._errors import InvalidKey, MissingKey
from idemflow._identity import MAX_KEY_LENGTH, parse_key

PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
FUZZ = settings(max_examples=300, deadline=None)


def quote(key: str) -> str:
    """The sf-string a careful client would send for ``key``."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def error(lines: list[str], *, strict: bool = False) -> str:
    with pytest.raises(InvalidKey) as exc_info:
        parse_key(lines, strict=strict)
    return str(exc_info.value)


class TestAccepted:
    @pytest.mark.parametrize(
        ("line", "key"),
        [
            ('"abc"', "abc"),
            ("abc", "abc"),
            ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
            ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
            ("KG5LxwFBepaKHyUD", "KG5LxwFBepaKHyUD"),
            (' \t"abc"\t ', "abc"),
            ("\t abc \t", "abc"),
            ('"a b"', "a b"),
            ('"a,b"', "a,b"),
            ('"a;b=c"', "a;b=c"),
            ('"a\\"b"', 'a"b'),
            ('"a\\\\b"', "a\\b"),
            ('"~!#$%&()*+-./:;<=>?@[]^_`{|}"', "~!#$%&()*+-./:;<=>?@[]^_`{|}"),
            ("~!#$%&'()*+-./:<=>?@[\\]^_`{|}", "~!#$%&'()*+-./:<=>?@[\\]^_`{|}"),
        ],
    )
    def test_valid_forms_yield_the_key(self, line: str, key: str) -> None:
        """A single quoted or bare value, with surrounding OWS, yields its key."""
        assert parse_key([line]) == key

    def test_quoted_and_bare_are_the_same_key(self) -> None:
        """``"abc"`` and ``abc`` name the same key."""
        assert parse_key(['"abc"']) == parse_key(["abc"]) == "abc"

    def test_accepts_a_tuple_of_lines(self) -> None:
        """Any sequence of field lines is accepted, not only a list."""
        assert parse_key(("abc",)) == "abc"

    @pytest.mark.parametrize("length", [1, MAX_KEY_LENGTH])
    def test_length_boundaries_are_accepted(self, length: int) -> None:
        """Keys of 1 and MAX_KEY_LENGTH characters are accepted in both forms."""
        key = "k" * length

        assert parse_key([key]) == key
        assert parse_key([quote(key)]) == key

    def test_escapes_do_not_count_towards_the_length(self) -> None:
        """The limit applies to the decoded key, so 255 escaped quotes fit."""
        key = '"' * MAX_KEY_LENGTH

        assert parse_key([quote(key)], strict=True) == key

    def test_max_key_length_is_255(self) -> None:
        """Keys may be as long as Stripe's."""
        assert MAX_KEY_LENGTH == 255


class TestRejected:
    def test_no_line_is_a_missing_key(self) -> None:
        """No Idempotency-Key line at all raises MissingKey, not InvalidKey."""
        with pytest.raises(MissingKey, match="required"):
            parse_key([])

    @pytest.mark.parametrize("count", [2, 3])
    def test_repeated_lines_are_invalid(self, count: int) -> None:
        """Repeated lines combine into a list, which is not a valid Item."""
        assert f"sent {count} times" in error(['"abc"'] * count)

    def test_repeated_identical_bare_lines_are_invalid(self) -> None:
        """Even two identical lines are refused rather than guessed at."""
        with pytest.raises(InvalidKey):
            parse_key(["abc", "abc"])

    @pytest.mark.parametrize(
        ("line", "fragment"),
        [
            ('"a", "b"', "lists are not allowed"),
            ('"a" , "b"', "lists are not allowed"),
            ('"a",', "lists are not allowed"),
            ("a, b", "lists are not allowed"),
            ("a,b", "lists are not allowed"),
            (",", "lists are not allowed"),
            ('"a";p=1', "parameters are not allowed"),
            ('"a" ;p', "parameters are not allowed"),
            ("abc;p=1", "parameters are not allowed"),  # issue 9: the bare form too
            ("abc;", "parameters are not allowed"),
            ('"a"b', "after the closing quote"),
            ('"a" "b"', "after the closing quote"),
            ('"abc', "no closing quote"),
            ('"', "no closing quote"),
            ('"abc\\', "no closing quote"),
            ('"abc\\"', "no closing quote"),
            ('"a\\nb"', "escapes are allowed"),
            ('"a\\u0041"', "escapes are allowed"),
            ('"a\\/"', "escapes are allowed"),
            ("a b", "may not contain a space"),
            ("a\tb", "may not contain a tab"),
            ('a"b', "double quote"),
            ('abc"', "double quote"),
        ],
    )
    def test_malformed_values(self, line: str, fragment: str) -> None:
        """Lists, parameters, junk, bad escapes and bare whitespace are refused."""
        assert fragment in error([line])

    @pytest.mark.parametrize(
        ("line", "fragment"),
        [
            ("a\x7fb", "DEL (U+007F)"),
            ('"a\x7fb"', "DEL (U+007F)"),
            ('"a\tb"', "a tab (U+0009)"),
            ("a\x00b", "a control character (U+0000)"),
            ('"a\x1fb"', "a control character (U+001F)"),
            ("café", "a non-ASCII character (U+00E9)"),
            ('"café"', "a non-ASCII character (U+00E9)"),
            ("\u2028", "a non-ASCII character (U+2028)"),
            ("key\U0001f600", "a non-ASCII character (U+1F600)"),
        ],
    )
    def test_characters_outside_printable_ascii(self, line: str, fragment: str) -> None:
        """Control characters, DEL and non-ASCII are refused and named by code point."""
        message = error([line])

        assert fragment in message
        assert "printable ASCII" in message

    @pytest.mark.parametrize("line", ["", "   ", " \t ", '""', ' "" '])
    def test_empty_keys(self, line: str) -> None:
        """An empty or all-whitespace value, quoted or not, is refused."""
        assert "empty" in error([line])

    def test_one_over_the_limit_is_refused(self) -> None:
        """A key of MAX_KEY_LENGTH + 1 characters is refused in both forms."""
        key = "k" * (MAX_KEY_LENGTH + 1)

        assert "longer than 255" in error([key])
        assert "longer than 255" in error([quote(key)])

    def test_huge_values_are_refused_as_too_long(self) -> None:
        """Values far over the limit are refused before they are scanned."""
        assert "longer than 255" in error(['"' + "k" * 100_000 + '"'])

    def test_too_many_escaped_characters(self) -> None:
        """256 escaped characters are one too many, even though each is legal."""
        assert "longer than 255" in error([quote("\\" * (MAX_KEY_LENGTH + 1))])

    def test_a_str_instead_of_lines_is_a_programming_error(self) -> None:
        """Passing the header value itself, not a sequence of lines, raises TypeError."""
        with pytest.raises(TypeError, match="not a str"):
            parse_key("abc")


class TestStrict:
    def test_quoted_form_is_accepted(self) -> None:
        """Strict mode accepts the sf-string the IETF draft requires."""
        assert parse_key(['"abc"'], strict=True) == "abc"

    def test_bare_form_is_refused(self) -> None:
        """Strict mode refuses a bare key and says the quoted form is required."""
        assert "must be a quoted string" in error(["abc"], strict=True)

    def test_strict_still_refuses_lists(self) -> None:
        """A list of quoted strings is refused in strict mode too."""
        assert "lists are not allowed" in error(['"a", "b"'], strict=True)

    def test_empty_is_reported_as_empty(self) -> None:
        """An empty value is reported as empty, not as unquoted."""
        assert "empty" in error([""], strict=True)


class TestMessages:
    def test_messages_quote_at_most_forty_characters(self) -> None:
        """Attacker input after the closing quote is cut to 40 characters."""
        message = error(['"a";' + "x" * 300])
        trailing = error(['"a"' + "x" * 300])

        assert "x" * 41 not in message
        assert "x" * 40 in trailing
        assert "x" * 41 not in trailing

    def test_messages_never_contain_raw_control_characters(self) -> None:
        """Quoted excerpts are escaped, so a key cannot forge log lines."""
        message = error(['"a"\r\nX-Admin: 1'])

        assert "\r" not in message
        assert "\n" not in message

    def test_messages_do_not_echo_invalid_keys(self) -> None:
        """A key refused for its characters is not repeated in the message."""
        assert "secret" not in error(["secret\x00value"])


@FUZZ
@given(lines=st.lists(st.text(), max_size=3), strict=st.booleans())
def test_fuzz_arbitrary_text_only_raises_key_errors(lines: list[str], strict: bool) -> None:
    """Any list of strings yields a valid key or raises MissingKey/InvalidKey."""
    try:
        key = parse_key(lines, strict=strict)
    except (InvalidKey, MissingKey):
        return

    assert 1 <= len(key) <= MAX_KEY_LENGTH
    assert all(" " <= ch <= "~" for ch in key)


HEADERISH = st.text(alphabet=st.sampled_from('"\\,; \t=a1\x00\x7fé'), max_size=12)


@FUZZ
@given(line=HEADERISH, strict=st.booleans())
def test_fuzz_tricky_characters_only_raise_key_errors(line: str, strict: bool) -> None:
    """Values made of quotes, escapes, commas and whitespace never crash the parser."""
    try:
        key = parse_key([line], strict=strict)
    except InvalidKey:
        return

    assert 1 <= len(key) <= MAX_KEY_LENGTH
    assert all(" " <= ch <= "~" for ch in key)


@FUZZ
@given(key=st.text(alphabet=PRINTABLE, min_size=1, max_size=MAX_KEY_LENGTH))
def test_every_printable_key_round_trips_through_the_quoted_form(key: str) -> None:
    """Any 1-255 character printable ASCII key survives quoting and parsing."""
    assert parse_key([quote(key)], strict=True) == key


@FUZZ
@given(
    key=st.text(
        alphabet=PRINTABLE.filter(lambda ch: ch not in ' ",;'),
        min_size=1,
        max_size=MAX_KEY_LENGTH,
    )
)
def test_every_token_like_key_round_trips_bare_and_quoted(key: str) -> None:
    """A key without space, quote, comma or semicolon parses the same bare and quoted."""
    assert parse_key([key]) == parse_key([quote(key)]) == key
