"""
MkDocs hooks (``hooks:`` in mkdocs.yml).

- Pages of the site that are files at the repository's root, written once and
  read on GitHub as well: ``docs/index.md``, ``docs/changelog.md`` and
  ``docs/developers.md`` are stubs whose Markdown is the root file's, its links
  rewritten from the root (``docs/core.md``) to the docs folder (``core.md``),
  so ``mkdocs build --strict`` checks them like any other page.
- A link from a page to a repository file outside ``docs/``
  (``../deploy/prometheus/alerts.yml``) works in the repository but is not a
  page of the site: there it becomes the file's path, in code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Site page -> the root file it shows.
ROOT_PAGES = {
    "index.md": "README.md",
    "changelog.md": "CHANGELOG.md",
    "developers.md": "DEVELOPERS.md",
}
#: Root files a root page may link to, as the site names them.
RENAMED = {root: page for page, root in ROOT_PAGES.items()}
_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def from_root(markdown: str) -> str:
    """Links written from the repository's root, as links from the docs folder."""

    def relink(found: re.Match[str]) -> str:
        target = found["target"]
        if "://" in target:
            return found[0]
        if target.startswith("docs/"):
            target = target.removeprefix("docs/")
        elif target in RENAMED:
            target = RENAMED[target]
        else:  # another repository file: a path one level up from docs/
            target = "../" + target
        return f"[{found['text']}]({target}{found['anchor'] or ''})"

    return _LINK.sub(relink, markdown)


def outside_docs_as_paths(markdown: str, page_uri: str) -> str:
    """Links that leave docs/ for another repository file, as that file's path."""
    folder = posixpath.dirname(page_uri)

    def unlink(found: re.Match[str]) -> str:
        target = found["target"]
        if "://" in target:
            return found[0]
        path = posixpath.normpath(posixpath.join("docs", folder, target))
        if path.startswith(("docs/", "..")):
            return found[0]
        text = found["text"]
        return text if path in text else f"{text} (`{path}`)"

    return _LINK.sub(unlink, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    uri = page.file.src_uri
    root = ROOT_PAGES.get(uri)
    if root is not None:
        markdown = from_root((ROOT / root).read_text())
    return outside_docs_as_paths(markdown, uri)
