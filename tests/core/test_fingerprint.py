from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemflow._errors import BodyTooLarge, InvalidBody
from idemflow._identity import DEFAULT_MAX_BODY_BYTES, canonical_json, canonical_query, fingerprint
from tests.factories import JSON_VALUES, reordered

FUZZ = settings(max_examples=200, deadline=None)
JSON = "application/json"


def fp(body: bytes, content_type: str | None = JSON, **kwargs: Any) -> str:
    return fingerprint("POST", "/payments", body, content_type=content_type, **kwargs)


class TestDigest:
    def test_format(self) -> None:
        """A fingerprint is ``sha256:`` and 64 lowercase hex digits."""
        assert re.fullmatch("sha256:[0-9a-f]{64}", fp(b'{"amount": 100}'))

    def test_pinned_encoding(self) -> None:
        """The digest covers the documented v1 encoding, byte for byte.

        Stored fingerprints must keep matching across releases; if this test
        has to change, so must the version tag.
        """
        expected = hashlib.sha256(
            b'idemflow-fp-v1\n4:POST\n9:/payments\njson\n{"amount":100,"currency":"EUR"}'
        ).hexdigest()

        assert fp(b'{"currency": "EUR", "amount": 100}') == "sha256:" + expected

    def test_pinned_raw_encoding(self) -> None:
        """Non-JSON bodies are hashed as sent, marked ``raw``."""
        expected = hashlib.sha256(b"idemflow-fp-v1\n4:POST\n9:/payments\nraw\namount=100")

        assert fp(b"amount=100", "application/x-www-form-urlencoded") == (
            "sha256:" + expected.hexdigest()
        )

    def test_is_deterministic(self) -> None:
        """The same request always gives the same fingerprint."""
        assert fp(b'{"a": 1}') == fp(b'{"a": 1}')


class TestWhatMatters:
    def test_key_order_and_whitespace_do_not_matter(self) -> None:
        """A JSON body re-serialised with other order and spacing matches."""
        assert fp(b'{"amount": 100, "currency": "EUR"}') == fp(
            b'{\n  "currency" : "EUR",\n  "amount" : 1e2\n}\n'
        )

    def test_method_changes_it(self) -> None:
        """The same body on another method is another request."""
        body = b'{"amount": 100}'

        assert fingerprint("POST", "/p", body) != fingerprint("PUT", "/p", body)

    def test_method_case_does_not_matter(self) -> None:
        """Methods are compared upper-cased."""
        assert fingerprint("post", "/p", b"x") == fingerprint("POST", "/p", b"x")

    def test_route_changes_it(self) -> None:
        """The same body on another route is another request."""
        body = b'{"amount": 100}'

        assert fingerprint("POST", "/a", body) != fingerprint("POST", "/b", body)

    def test_body_changes_it(self) -> None:
        """A different amount is a different request."""
        assert fp(b'{"amount": 100}') != fp(b'{"amount": 101}')

    def test_neighbouring_large_integers_differ(self) -> None:
        """Amounts above 2**53 are compared exactly, not as rounded doubles."""
        assert fp(b'{"amount": 9007199254740992}') != fp(b'{"amount": 9007199254740993}')

    def test_json_and_raw_bodies_differ(self) -> None:
        """The same bytes declared as JSON and as text are different requests."""
        body = b'{"a":1}'

        assert fp(body, JSON) != fp(body, "text/plain")

    def test_length_prefixes_keep_fields_apart(self) -> None:
        """A route cannot absorb the body kind and shift the boundary."""
        body = b'{"a":1}'
        tricky = fingerprint("POST", "/a\nraw", body, content_type=JSON)
        shifted = fingerprint("POST", "/a", b"json\n" + body, content_type="text/plain")

        assert tricky != shifted

    def test_method_and_route_boundary(self) -> None:
        """Characters cannot move between the method and the route."""
        assert fingerprint("POST", "/a", b"") != fingerprint("POS", "T/a", b"")

    def test_any_route_string_is_accepted(self) -> None:
        """Routes with lone surrogates (from a lax path decoder) still fingerprint."""
        assert fingerprint("POST", "/\udcff", b"") != fingerprint("POST", "/\udcfe", b"")


class TestExcludeFields:
    def test_excluded_fields_do_not_matter(self) -> None:
        """Per-attempt fields named in exclude_fields are left out."""
        first = fp(
            b'{"amount": 100, "sent_at": 1, "meta": {"attempt": 1}}',
            exclude_fields=["sent_at", "meta.attempt"],
        )
        retry = fp(
            b'{"amount": 100, "sent_at": 2, "meta": {"attempt": 2}}',
            exclude_fields=["sent_at", "meta.attempt"],
        )

        assert first == retry
        assert first == fp(b'{"amount": 100, "meta": {}}')

    def test_other_fields_still_matter(self) -> None:
        """Excluding one field does not hide changes to the others."""
        assert fp(b'{"amount": 100, "sent_at": 1}', exclude_fields=["sent_at"]) != fp(
            b'{"amount": 101, "sent_at": 1}', exclude_fields=["sent_at"]
        )

    def test_ignored_for_raw_bodies(self) -> None:
        """Non-JSON bodies are hashed whole, whatever exclude_fields says."""
        body = b'{"amount": 100, "sent_at": 1}'

        assert fp(body, "text/plain", exclude_fields=["sent_at"]) == fp(body, "text/plain")

    def test_a_str_instead_of_names_is_a_programming_error(self) -> None:
        """One name passed as a bare str raises TypeError, whatever the body."""
        with pytest.raises(TypeError, match="not a str"):
            fp(b"x", "text/plain", exclude_fields="sent_at")


class TestMediaTypes:
    @pytest.mark.parametrize(
        "content_type",
        [
            "application/json",
            "APPLICATION/JSON",
            "application/json; charset=utf-8",
            " application/json ;charset=UTF-8",
            "application/problem+json",
            "application/vnd.api+json; ext=bulk",
            "application/merge-patch+JSON",
        ],
    )
    def test_json_media_types_are_canonicalised(self, content_type: str) -> None:
        """``application/json`` and ``+json`` types hash the canonical form."""
        assert fp(b'{"b": 1, "a": 2}', content_type) == fp(b'{"a":2,"b":1}', JSON)

    @pytest.mark.parametrize(
        "content_type",
        [
            None,
            "",
            "text/plain",
            "text/json",
            "application/jsonx",
            "application/json-seq",
            "+json",
            "json",
            "application/x-www-form-urlencoded",
        ],
    )
    def test_other_media_types_are_hashed_raw(self, content_type: str | None) -> None:
        """Anything else is hashed as sent, so reordering changes the fingerprint."""
        assert fp(b'{"b": 1, "a": 2}', content_type) != fp(b'{"a":2,"b":1}', content_type)

    def test_non_json_body_declared_as_json_is_refused(self) -> None:
        """A body that claims to be JSON and is not raises InvalidBody."""
        with pytest.raises(InvalidBody, match="not valid JSON"):
            fp(b"amount=100")

    def test_invalid_json_is_only_checked_when_declared(self) -> None:
        """The same bytes are fine as an opaque body."""
        assert fp(b"amount=100", "text/plain").startswith("sha256:")

    def test_empty_json_body_is_allowed(self) -> None:
        """A bodyless request declared as JSON fingerprints as empty."""
        assert fp(b"") == fp(b"", exclude_fields=["a"])
        assert fp(b"") != fp(b'""')
        assert fp(b"") != fp(b"", "text/plain")


class TestSizeCap:
    def test_default_cap_is_one_mebibyte(self) -> None:
        """The default cap is 1 MiB."""
        assert DEFAULT_MAX_BODY_BYTES == 1_048_576

    def test_body_at_the_cap_is_accepted(self) -> None:
        """A body of exactly max_body_bytes is fingerprinted."""
        assert fp(b"x" * 10, "text/plain", max_body_bytes=10).startswith("sha256:")

    def test_body_over_the_cap_is_refused(self) -> None:
        """One byte over the cap raises InvalidBody naming the limit."""
        with pytest.raises(InvalidBody, match="limit for idempotent requests is 10 bytes"):
            fp(b"x" * 11, "text/plain", max_body_bytes=10)

    def test_default_cap_applies(self) -> None:
        """Without max_body_bytes, bodies over 1 MiB are refused."""
        with pytest.raises(InvalidBody, match="1048576 bytes"):
            fp(b" " * (DEFAULT_MAX_BODY_BYTES + 1), "text/plain")

    def test_cap_is_checked_before_parsing(self) -> None:
        """An oversized body is refused for its size, without being parsed."""
        with pytest.raises(InvalidBody, match="limit"):
            fp(b"[" * 100, max_body_bytes=50)

    def test_over_the_cap_is_413(self) -> None:
        """Too large is its own error, 413, still an InvalidBody."""
        with pytest.raises(BodyTooLarge) as caught:
            fp(b"x" * 11, "text/plain", max_body_bytes=10)
        assert caught.value.status == 413
        assert caught.value.slug == "body-too-large"


class TestQuery:
    """Issue 9, defect 9: the query string is part of the request."""

    def test_no_query_hashes_as_before(self) -> None:
        """A request without a query keeps the fingerprint it always had."""
        body = b'{"a":1}'
        assert fp(body, query="") == fp(body) == fp(body, query=b"") == fp(body, query="?")
        assert fp(body) == fp(body, query="&")

    def test_another_query_is_another_request(self) -> None:
        assert fp(b"{}", query="x=1") != fp(b"{}", query="x=2")
        assert fp(b"{}", query="x=1") != fp(b"{}")

    def test_order_and_escaping_do_not_matter(self) -> None:
        assert fp(b"{}", query="b=2&a=1") == fp(b"{}", query="a=%31&b=2")
        assert fp(b"{}", query="a=x+y") == fp(b"{}", query="a=x%20y")

    def test_the_query_cannot_move_into_the_route_or_the_body(self) -> None:
        """The query is length-prefixed under a tag no body kind uses."""
        with_query = fingerprint("POST", "/a", b"raw\nx", query="q=1")
        assert with_query != fingerprint("POST", "/a?q=1", b"raw\nx")
        assert with_query != fingerprint("POST", "/a", b"query\n3:q=1\nraw\nx")

    @pytest.mark.parametrize(
        ("query", "canonical"),
        [
            ("", b""),
            ("b=2&a=1", b"a=1&b=2"),
            ("a&a=", b"a=&a="),
            ("a=1&&b=2", b"a=1&b=2"),
            ("x=%ff", b"x=%FF"),
            ("k%3Dv=1", b"k%3Dv=1"),
            ("a=2&a=1", b"a=1&a=2"),
        ],
    )
    def test_canonical_form(self, query: str, canonical: bytes) -> None:
        assert canonical_query(query) == canonical

    @FUZZ
    @given(pairs=st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=5))
    def test_canonical_is_a_fixed_point(self, pairs: list[tuple[str, str]]) -> None:
        from urllib.parse import urlencode

        once = canonical_query(urlencode(pairs))
        assert canonical_query(once) == once


@FUZZ
@given(
    body=st.binary(max_size=64),
    content_type=st.sampled_from([None, JSON, "text/plain", "application/x+json"]),
)
def test_fuzz_arbitrary_bodies_only_raise_invalid_body(
    body: bytes, content_type: str | None
) -> None:
    """Any body either fingerprints or raises InvalidBody."""
    try:
        result = fp(body, content_type, exclude_fields=["a", "a.b"], max_body_bytes=48)
    except InvalidBody:
        return

    assert re.fullmatch("sha256:[0-9a-f]{64}", result)


@FUZZ
@given(
    value=JSON_VALUES,
    rnd=st.randoms(use_true_random=False),
    indent=st.none() | st.integers(0, 4) | st.just("\t"),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
    ensure_ascii=st.booleans(),
)
def test_reserialised_json_fingerprints_the_same(
    value: Any,
    rnd: random.Random,
    indent: int | str | None,
    separators: tuple[str, str],
    ensure_ascii: bool,
) -> None:
    """Shuffled member order, indentation and escaping never change the fingerprint."""
    data = json.dumps(
        reordered(value, rnd), indent=indent, separators=separators, ensure_ascii=ensure_ascii
    )

    assert fp(data.encode()) == fp(canonical_json(value))
