"""
Every problem type idemflow (and its demo) answers with is published: its
``type`` URI is a page of the docs site saying its status, whether it is
retryable and what the client should do, and the page agrees with the code
that builds the body. (The HTTP tests hold every body they see to the page:
``tests.http.conftest.assert_problem``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from idemflow import IdempotencyError, Response, Verdict
from idemflow._errors import PROBLEM_BASE, problem_types
from idemflow._http import NOT_STORED_SLUG, is_retryable, not_stored, problem, problem_for
from tests.problem_pages import PAGES, SECTIONS, page, pages

DEMO = Path(__file__).resolve().parents[2] / "demo" / "src" / "idemflow_demo"
#: ``slug="…"`` arguments and ``slug = "…"`` class attributes in the demo's source.
DEMO_SLUG = re.compile(r"""\bslug\s*=\s*["']([a-z0-9-]+)["']""")
#: The demo's catch-all for other framework errors (``title.lower()`` of "Error").
DEMO_FALLBACK = {"not-found", "method-not-allowed", "error"}


def library_types() -> dict[str, type[IdempotencyError]]:
    return problem_types()


def demo_slugs() -> set[str]:
    found = {s for f in DEMO.glob("*.py") for s in DEMO_SLUG.findall(f.read_text())}
    assert found, "no slug found in the demo: has its problem() call changed shape?"
    return found | DEMO_FALLBACK


@pytest.mark.parametrize("slug", sorted(problem_types()))
def test_every_library_error_type_has_a_page_that_agrees_with_its_class(slug: str) -> None:
    error = library_types()[slug]
    published = page(slug)
    assert published.uri == PROBLEM_BASE + slug
    assert published.status == error.status
    assert published.retryable is error.retryable
    assert not published.demo
    for section in SECTIONS:
        assert section in published.text, f"{slug}.md has no {section!r}"
    body = json.loads(problem_for(error("x")).body)
    assert (body["type"], body["status"], body["retryable"]) == (
        published.uri,
        published.status,
        published.retryable,
    )


def test_the_not_stored_marker_has_a_page_and_its_verdict_says_if_it_is_retryable() -> None:
    published = page(NOT_STORED_SLUG)
    original = Response(201, b"{}", (("location", "/orders/7"),))
    settled = json.loads(not_stored(original, "too large", Verdict.COMPLETED).body)
    released = json.loads(not_stored(Response(503), "too large", Verdict.TRANSIENT).body)
    assert settled["type"] == released["type"] == published.uri
    assert settled["retryable"] is published.retryable is False
    assert released["retryable"] is True
    assert '"retryable": true' in published.text  # the page explains the released variant


@pytest.mark.parametrize("slug", sorted(demo_slugs()))
def test_every_demo_problem_type_has_a_page(slug: str) -> None:
    published = page(slug)
    assert published.uri == PROBLEM_BASE + slug
    assert published.demo or slug in problem_types()
    for section in SECTIONS:
        assert section in published.text
    if published.status is not None:
        body = json.loads(problem(published.status, "t", "d", slug=slug).body)
        assert body["retryable"] is published.retryable


def test_every_page_is_a_type_and_is_listed_in_the_index() -> None:
    known = set(problem_types()) | {NOT_STORED_SLUG} | demo_slugs()
    assert set(pages()) == known
    index = (PAGES / "index.md").read_text()
    for slug in pages():
        assert f"[`{slug}`]({slug}.md)" in index, f"{slug} is not in docs/problems/index.md"


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(400, False), (402, False), (404, False), (408, True), (409, False), (429, True), (500, True)],
)
def test_an_applications_own_problem_is_retryable_when_its_outcome_is_released(
    status: int, retryable: bool
) -> None:
    """Not an idemflow type: transient (released, not stored) by the default classifier."""
    assert is_retryable("out-of-stock", status) is retryable
    body = json.loads(problem(status, "t", "d", slug="out-of-stock").body)
    assert body["retryable"] is retryable
    assert json.loads(problem(409, "t", "d", slug="x", retryable=True).body)["retryable"] is True
