from __future__ import annotations

import json
import random
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemflow._errors import InvalidBody
from idemflow._identity import MAX_DEPTH, canonical_json, canonical_json_bytes, parse_json
from tests.factories import JSON_VALUES, reordered

FUZZ = settings(max_examples=300, deadline=None)


def canonical(data: bytes, *exclude: str) -> str:
    return canonical_json_bytes(data, exclude).decode("utf-8")


def double(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


class TestRFC8785Vectors:
    # RFC 8785 Appendix B: IEEE 754 bit patterns and their canonical text.
    @pytest.mark.parametrize(
        ("bits", "text"),
        [
            ("0000000000000000", "0"),
            ("8000000000000000", "0"),
            ("0000000000000001", "5e-324"),
            ("8000000000000001", "-5e-324"),
            ("7fefffffffffffff", "1.7976931348623157e+308"),
            ("ffefffffffffffff", "-1.7976931348623157e+308"),
            ("4340000000000000", "9007199254740992"),
            ("c340000000000000", "-9007199254740992"),
            ("4430000000000000", "295147905179352830000"),
            ("44b52d02c7e14af5", "9.999999999999997e+22"),
            ("44b52d02c7e14af6", "1e+23"),
            ("44b52d02c7e14af7", "1.0000000000000001e+23"),
            ("444b1ae4d6e2ef4e", "999999999999999700000"),
            ("444b1ae4d6e2ef4f", "999999999999999900000"),
            ("444b1ae4d6e2ef50", "1e+21"),
            ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
            ("3eb0c6f7a0b5ed8d", "0.000001"),
            ("41b3de4355555553", "333333333.3333332"),
            ("41b3de4355555554", "333333333.33333325"),
            ("41b3de4355555555", "333333333.3333333"),
            ("41b3de4355555556", "333333333.3333334"),
            ("41b3de4355555557", "333333333.33333343"),
            ("becbf647612f3696", "-0.0000033333333333333333"),
            ("43143ff3c1cb0959", "1424953923781206.2"),
        ],
    )
    def test_appendix_b_numbers(self, bits: str, text: str) -> None:
        """Every finite double in RFC 8785 Appendix B is written as the RFC says."""
        assert canonical_json(double(bits)) == text.encode()

    @pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
    def test_appendix_b_non_finite_numbers_are_errors(self, bits: str) -> None:
        """NaN and the infinities have no JSON form, so serialising them fails."""
        with pytest.raises(ValueError, match="no such number"):
            canonical_json(double(bits))

    def test_section_3_2_2_example(self) -> None:
        """The RFC's combined example (§3.2.2) canonicalises byte for byte."""
        data = (
            b'{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
            b' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
            b' "literals": [null, true, false]}'
        )

        assert (
            canonical_json_bytes(data)
            == (
                '{"literals":[null,true,false],'
                '"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
                '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
            ).encode()
        )

    def test_section_3_2_3_sorting(self) -> None:
        """Members sort by UTF-16 code units, so U+1F600 comes before U+FB33 (§3.2.3)."""
        data = (
            b"{"
            b'"\\u20ac": "Euro Sign", '
            b'"\\r": "Carriage Return", '
            b'"\\ufb33": "Hebrew Letter Dalet With Dagesh", '
            b'"1": "One", '
            b'"\\ud83d\\ude00": "Emoji: Grinning Face", '
            b'"\\u0080": "Control", '
            b'"\\u00f6": "Latin Small Letter O With Diaeresis"'
            b"}"
        )

        assert canonical(data) == (
            '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
            '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
            '"\U0001f600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
        )

    def test_html_is_not_escaped(self) -> None:
        """``</script>`` sorts between "1" and U+0080 and keeps its ``<``, ``/`` and ``>``."""
        value = {"\u0080": 0, "</script>": 1, "1": 2}

        assert canonical_json(value) == '{"1":2,"</script>":1,"\u0080":0}'.encode()


class TestNumbers:
    @pytest.mark.parametrize(
        ("value", "text"),
        [
            (1.0, "1"),
            (-0.0, "0"),
            (0.0, "0"),
            (100.0, "100"),
            (0.1, "0.1"),
            (-1.5, "-1.5"),
            (1e20, "100000000000000000000"),
            (1e21, "1e+21"),
            (1.5e300, "1.5e+300"),
            (1e-6, "0.000001"),
            (1e-7, "1e-7"),
            (1.25e-7, "1.25e-7"),
            (123e-20, "1.23e-18"),
            (333333333.3333333, "333333333.3333333"),
        ],
    )
    def test_floats_use_ecmascript_layout(self, value: float, text: str) -> None:
        """Doubles are written like ``Number.prototype.toString``."""
        assert canonical_json(value) == text.encode()

    @pytest.mark.parametrize("spelling", [b"1", b"1.0", b"1E0", b"10e-1", b"0.1e1", b"-0", b"1.00"])
    def test_spellings_of_one_value_agree(self, spelling: bytes) -> None:
        """Different spellings of one small number canonicalise the same."""
        expected = "0" if spelling == b"-0" else "1"

        assert canonical(spelling) == expected

    @pytest.mark.parametrize(
        ("value", "text"),
        [
            (0, "0"),
            (-7, "-7"),
            (2**53, "9007199254740992"),
            (2**53 + 1, "9007199254740993"),
            (-(2**53) - 1, "-9007199254740993"),
            (10**21, "1000000000000000000000"),
            (12345678901234567890123, "12345678901234567890123"),
        ],
    )
    def test_integers_are_exact(self, value: int, text: str) -> None:
        """Ints are written with their exact digits (the documented deviation)."""
        assert canonical_json(value) == text.encode()

    def test_neighbouring_large_amounts_stay_distinct(self) -> None:
        """2**53 and 2**53 + 1 canonicalise differently, unlike plain RFC 8785."""
        assert canonical(b"9007199254740992") != canonical(b"9007199254740993")

    def test_bool_and_none(self) -> None:
        """Literals are written as JSON literals, not as numbers."""
        assert canonical_json([True, False, None]) == b"[true,false,null]"


class TestStrings:
    def test_short_escapes(self) -> None:
        """Quote, backslash and the five short control escapes use their short form."""
        assert canonical_json('"\\\b\t\n\f\r') == b'"\\"\\\\\\b\\t\\n\\f\\r"'

    @pytest.mark.parametrize("code", [c for c in range(0x20) if chr(c) not in "\b\t\n\f\r"])
    def test_other_controls_use_lowercase_unicode_escapes(self, code: int) -> None:
        """Control characters without a short escape become ``\\u00xx`` in lowercase."""
        assert canonical_json(chr(code)) == f'"\\u{code:04x}"'.encode()

    @pytest.mark.parametrize(
        "text", ["/", "\x7f", "\u2028", "\u2029", "é", "€", "\U0001f600", "<>&'"]
    )
    def test_everything_else_is_literal_utf8(self, text: str) -> None:
        """DEL, slashes, line separators and non-ASCII are written as themselves."""
        assert canonical_json(text) == ('"' + text + '"').encode("utf-8")

    def test_escaped_input_is_unescaped(self) -> None:
        """Escapes in the input are decoded and only re-escaped where JCS requires."""
        assert canonical(b'"\\u0041\\/\\u00e9\\ud83d\\ude00"') == '"A/é\U0001f600"'


class TestSerialiserInputs:
    def test_tuples_are_arrays(self) -> None:
        """A tuple is serialised like a list."""
        assert canonical_json((1, "a")) == b'[1,"a"]'

    def test_nested_structures(self) -> None:
        """Objects sort at every level and arrays keep their order."""
        value = {"b": [3, {"z": 1, "y": 2}], "a": {}}

        assert canonical_json(value) == b'{"a":{},"b":[3,{"y":2,"z":1}]}'

    @pytest.mark.parametrize("value", [{1, 2}, b"bytes", object(), {1: "a"}, [{("a",): 1}]])
    def test_unsupported_values_are_type_errors(self, value: object) -> None:
        """Sets, bytes, arbitrary objects and non-str names are TypeErrors."""
        with pytest.raises(TypeError):
            canonical_json(value)

    @pytest.mark.parametrize("value", ["\ud800", {"\udc00": 1}, ["a\ud83d"]])
    def test_lone_surrogates_are_value_errors(self, value: object) -> None:
        """A str that is not valid Unicode cannot be canonicalised."""
        with pytest.raises(ValueError, match="surrogate"):
            canonical_json(value)


class TestParseJson:
    @pytest.mark.parametrize(
        ("data", "value"),
        [
            (b"{}", {}),
            (b' [1, 2.5, "x"] \r\n', [1, 2.5, "x"]),
            (b"null", None),
            (b'"\\ud83d\\ude00"', "\U0001f600"),
            (b'{"a": {"a": 1}}', {"a": {"a": 1}}),
            (b"1e-400", 0.0),
        ],
    )
    def test_valid_documents(self, data: bytes, value: Any) -> None:
        """Any I-JSON value, including top-level scalars, parses."""
        assert parse_json(data) == value

    @pytest.mark.parametrize(
        ("data", "fragment"),
        [
            (b"", "not valid JSON"),
            (b" ", "not valid JSON"),
            (b"{'a': 1}", "not valid JSON"),
            (b"[1,]", "not valid JSON"),
            (b"[1] // note", "not valid JSON"),
            (b"{} {}", "not valid JSON: Extra data"),
            (b"[1] x", "not valid JSON: Extra data"),
            (b'"a\nb"', "not valid JSON"),
            (b"01", "not valid JSON"),
            (b'{"a": 1, "a": 2}', "repeats the member name 'a'"),
            (b'{"a": 1, "\\u0061": 2}', "repeats the member name 'a'"),
            (b'[{"x": {"k": 1, "k": 1}}]', "repeats the member name 'k'"),
            (b"NaN", "NaN"),
            (b"[Infinity]", "Infinity"),
            (b'{"a": -Infinity}', "-Infinity"),
            (b"1e400", "too large for a double"),
            (b"[-1e400]", "too large for a double"),
            (b'"\\ud800"', "unpaired UTF-16 surrogate"),
            (b'"\\udc00"', "unpaired UTF-16 surrogate"),
            (b'"\\ude00\\ud83d"', "unpaired UTF-16 surrogate"),
            (b'"x\\ud83d"', "unpaired UTF-16 surrogate"),
            (b'{"\\ud800": 1}', "unpaired UTF-16 surrogate"),
            (b"\xff", "not valid UTF-8"),
            (b'"\xc3"', "not valid UTF-8 (bad byte at offset 1)"),
            (b'"\xc0\xaf"', "not valid UTF-8"),
            (b'"\xed\xa0\x80"', "not valid UTF-8"),
            (b"\xef\xbb\xbf{}", "byte order mark"),
            (b"\xff\xfe{\x00}\x00", "not valid UTF-8"),
            (b"1" * 5000, "integer with 5000 digits"),
            (b"[" * 100_000, "nests deeper than"),
        ],
    )
    def test_invalid_documents(self, data: bytes, fragment: str) -> None:
        """Everything strict I-JSON forbids raises InvalidBody saying why."""
        with pytest.raises(InvalidBody) as exc_info:
            parse_json(data)

        assert fragment in str(exc_info.value)

    def test_nesting_up_to_the_limit_is_accepted(self) -> None:
        """MAX_DEPTH nested arrays parse and canonicalise."""
        data = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH

        assert canonical_json_bytes(data) == data

    def test_nesting_beyond_the_limit_is_refused(self) -> None:
        """One level more than MAX_DEPTH is refused, objects counting like arrays."""
        data = b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)

        with pytest.raises(InvalidBody, match=f"deeper than {MAX_DEPTH}"):
            parse_json(data)

    @pytest.mark.parametrize(
        "data",
        [
            b"[" * 10_000 + b"]" * 10_000,
            b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
            b'{"a":[' * 5_000 + b"]}" * 5_000,
        ],
    )
    def test_10000_deep_bodies_are_invalid_even_deep_in_a_call_stack(self, data: bytes) -> None:
        """Issue 9, defect 12: deep JSON is InvalidBody wherever it is read, never a 500.

        An ASGI server, middleware and the endpoint already use part of the
        stack when the body is parsed; the refusal must not depend on how much.
        """
        import sys

        def nested(levels: int) -> None:
            if levels:
                nested(levels - 1)
                return
            with pytest.raises(InvalidBody, match="deeper than"):
                canonical_json_bytes(data)

        nested(sys.getrecursionlimit() // 2)

    def test_messages_do_not_echo_the_body(self) -> None:
        """Parse errors name the problem and its position, never the body's content."""
        with pytest.raises(InvalidBody) as exc_info:
            parse_json(b'{"card": "4111111111111111" oops}')

        assert "4111" not in str(exc_info.value)
        assert "line 1, column 29" in str(exc_info.value)

    def test_long_duplicate_names_are_cut(self) -> None:
        """A repeated member name is quoted to at most 40 characters."""
        name = "n" * 200
        data = json.dumps({name: 1}).encode()[:-1] + b", " + json.dumps(name).encode() + b": 2}"

        with pytest.raises(InvalidBody) as exc_info:
            parse_json(data)

        assert "n" * 40 in str(exc_info.value)
        assert "n" * 41 not in str(exc_info.value)


class TestExcludeFields:
    BODY = b'{"amount": 100, "sent_at": "12:00", "meta": {"trace": "t1", "note": "n"}, "x.y": 1}'

    def test_top_level_member_is_dropped(self) -> None:
        """A top-level name is left out of the canonical form."""
        assert canonical(self.BODY, "sent_at") == (
            '{"amount":100,"meta":{"note":"n","trace":"t1"},"x.y":1}'
        )

    def test_dotted_path_drops_a_nested_member(self) -> None:
        """``meta.trace`` drops member ``trace`` of object ``meta`` only."""
        assert canonical(self.BODY, "meta.trace", "sent_at") == (
            '{"amount":100,"meta":{"note":"n"},"x.y":1}'
        )

    @pytest.mark.parametrize(
        "path", ["missing", "meta.missing", "missing.deeper", "amount.x", "meta.note.x", "x.y"]
    )
    def test_paths_that_do_not_exist_are_ignored(self, path: str) -> None:
        """Missing members and paths through non-objects change nothing.

        A dot always separates segments, so a member literally named ``x.y``
        cannot be excluded.
        """
        assert canonical(self.BODY, path) == canonical(self.BODY)

    def test_paths_do_not_descend_into_arrays(self) -> None:
        """Excluding ``items.id`` leaves objects inside an array alone."""
        data = b'{"items": [{"id": 1}]}'

        assert canonical(data, "items.id") == '{"items":[{"id":1}]}'

    def test_non_object_documents_are_unchanged(self) -> None:
        """Exclusions on an array or scalar document are ignored."""
        assert canonical(b'[{"a": 1}]', "a") == '[{"a":1}]'
        assert canonical(b'"a"', "a") == '"a"'

    def test_a_str_instead_of_names_is_a_programming_error(self) -> None:
        """Passing one name as a bare str raises TypeError instead of dropping letters."""
        with pytest.raises(TypeError, match="not a str"):
            canonical_json_bytes(self.BODY, "amount")


@FUZZ
@given(data=st.binary(max_size=64))
def test_fuzz_arbitrary_bytes_only_raise_invalid_body(data: bytes) -> None:
    """Any bytes either parse and canonicalise or raise InvalidBody."""
    try:
        parse_json(data)
        canonical_json_bytes(data, ["a", "a.b"])
    except InvalidBody:
        pass


JSONISH = st.text(alphabet=st.sampled_from('{}[]",:0123456789.eE+-\\u dDtruefalsnNI '), max_size=40)


@FUZZ
@given(text=JSONISH)
def test_fuzz_json_like_text_only_raises_invalid_body(text: str) -> None:
    """Text made of JSON's own characters either canonicalises or raises InvalidBody."""
    try:
        result = canonical_json_bytes(text.encode())
    except InvalidBody:
        return

    # Whatever parsed is now in canonical form, so it canonicalises to itself.
    assert canonical_json_bytes(result) == result


@FUZZ
@given(value=JSON_VALUES)
def test_canonical_form_is_idempotent(value: Any) -> None:
    """Parsing canonical JSON and canonicalising again gives the same bytes."""
    once = canonical_json(value)

    assert canonical_json(parse_json(once)) == once


@FUZZ
@given(
    value=JSON_VALUES,
    rnd=st.randoms(use_true_random=False),
    indent=st.none() | st.integers(0, 4) | st.just("\t"),
    ensure_ascii=st.booleans(),
)
def test_serialisation_details_do_not_matter(
    value: Any, rnd: random.Random, indent: int | str | None, ensure_ascii: bool
) -> None:
    """Member order, indentation and ASCII escaping do not change the canonical form."""
    data = json.dumps(reordered(value, rnd), indent=indent, ensure_ascii=ensure_ascii)

    assert canonical_json_bytes(data.encode()) == canonical_json(value)


@given(
    value=JSON_VALUES,
    exclude=st.lists(st.text(st.characters(blacklist_characters="."), max_size=3), max_size=2),
)
def test_the_c_encoder_fast_path_writes_exactly_rfc_8785(value: Any, exclude: list[str]) -> None:
    """Float-free values are written by ``json``'s C encoder: the same bytes as the RFC writer."""
    data = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    try:
        expected_value = parse_json(data)
    except InvalidBody:
        return  # a lone surrogate: refused on either path
    for path in exclude:
        if isinstance(expected_value, dict):
            expected_value.pop(path, None)
    assert canonical_json_bytes(data, exclude) == canonical_json(expected_value)


@pytest.mark.parametrize(
    "body",
    [
        '{"\\ud83d\\ude00":1,"\\uffff":2,"a":[true,false,null,"\\u0000\\u001f\\u007f\\u2028"]}',
        '{"b":"\\"\\\\\\b\\f\\n\\r\\t","a":-12345678901234567890123,"\\u00e9":{}}',
        '["\\ud83d\\ude00", {"z": 1, "\\uff21": 2, "\\ud800\\udc00": 3}]',
        '{"amount":1000,"currency":"EUR","n":1.0}',
    ],
)
def test_the_fast_path_agrees_on_escapes_astral_names_and_big_ints(body: str) -> None:
    """Names beyond the BMP sort by UTF-16 units (the RFC writer); everything else is alike."""
    assert canonical_json_bytes(body.encode()) == canonical_json(parse_json(body.encode()))
