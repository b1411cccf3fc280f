"""
The published problem pages, ``docs/problems/<slug>.md``: what each says of its type.

Each page opens with one line naming its ``type`` URI, its status and whether
it is retryable; the HTTP tests hold every problem body they see to it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from idemflow._errors import PROBLEM_BASE

PAGES = Path(__file__).resolve().parent.parent / "docs" / "problems"
SUMMARY = re.compile(
    r"^`(?P<uri>[^`]+)` · status \*\*(?P<status>\w+)\*\* · retryable \*\*(?P<retryable>yes|no)\*\*",
    re.MULTILINE,
)
SECTIONS = ("## Should the client retry?", "## Should the client change anything?")


@dataclass(frozen=True)
class Page:
    slug: str
    uri: str
    status: int | None  # None: the type has more than one status (the demo's "error")
    retryable: bool
    demo: bool
    text: str


@functools.cache
def page(slug: str) -> Page:
    """The page of problem type ``slug``; AssertionError if it has none or no summary line."""
    path = PAGES / f"{slug}.md"
    assert path.is_file(), f"problem type {slug!r} has no page {path.name} in docs/problems/"
    text = path.read_text()
    found = SUMMARY.search(text)
    assert found, f"{path.name} has no summary line (`type` · status **N** · retryable **yes|no**)"
    status = found["status"]
    return Page(
        slug,
        found["uri"],
        int(status) if status.isdigit() else None,
        found["retryable"] == "yes",
        "(demo)" in text.splitlines()[0],
        text,
    )


def slug_of(type_uri: str) -> str:
    assert type_uri.startswith(PROBLEM_BASE), type_uri
    return type_uri.removeprefix(PROBLEM_BASE)


def pages() -> list[str]:
    """Every problem page's slug (the index is not one)."""
    return sorted(p.stem for p in PAGES.glob("*.md") if p.stem != "index")
