"""
The documentation site builds with ``mkdocs build --strict`` (a broken link,
anchor or API reference fails it), offline, and holds what it promises: an API
reference of one page per public module, listing every public name and no other,
and a page for every problem type at the path its ``type`` URI names.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import idemflow
from idemflow._errors import PROBLEM_BASE
from tests.problem_pages import pages

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")
#: Public modules that are not API: the CLI is documented by its --help and docs/operations.md.
NOT_API = ("idemflow.cli", "idemflow.integrations.django.")


def _not_api(module: str) -> bool:
    """The CLI and what is below it (not ``idemflow.client``), the Django app's modules."""
    return module == "idemflow.cli" or module.startswith(("idemflow.cli.", *NOT_API[1:]))


def public_modules() -> list[str]:
    """``idemflow`` and every module under it whose dotted name has no ``_`` part."""
    found = ["idemflow"]
    for module in pkgutil.walk_packages(idemflow.__path__, "idemflow."):
        parts = module.name.split(".")
        if any(p.startswith("_") for p in parts) or _not_api(module.name):
            continue
        if module.name.startswith("idemflow.integrations.django") and module.name != (
            "idemflow.integrations.django"
        ):
            continue
        found.append(module.name)
    return found


#: A module docstring says what the module is for; the long story lives in docs/.
MAX_MODULE_DOCSTRING_LINES = 15


def module_docstrings() -> dict[str, str]:
    """Every module docstring under ``src/idemflow``, by path (generated twins included)."""
    found = {}
    for path in sorted((ROOT / "src" / "idemflow").rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring:
            found[str(path.relative_to(ROOT))] = docstring
    return found


def test_every_module_docstring_is_short_and_names_pages_that_exist() -> None:
    too_long, missing = [], []
    for path, docstring in module_docstrings().items():
        lines = len(docstring.strip().splitlines())
        if lines > MAX_MODULE_DOCSTRING_LINES:
            too_long.append(f"{path}: {lines} lines")
        missing += [
            f"{path}: {page}"
            for page in re.findall(r"docs/[\w/.-]+\.md", docstring)
            if not (ROOT / page).is_file()
        ]
    assert not too_long, (
        f"over {MAX_MODULE_DOCSTRING_LINES} lines (move the essay to docs/): {too_long}"
    )
    assert not missing, f"docstrings name pages that do not exist: {missing}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MKDOCS.exists():
        pytest.fail("mkdocs is not installed: scripts/bootstrap installs the docs extra")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def anchors(site: Path) -> set[str]:
    found: set[str] = set()
    for page in (site / "reference").rglob("index.html"):
        found |= set(re.findall(r'id="(idemflow[\w.]*)"', page.read_text()))
    return found


def reexported_from_the_edge(module: object, member: str) -> bool:
    """A framework module's re-export of an ``idemflow.edge`` name: documented there, once."""
    import idemflow.edge

    found = getattr(module, member)
    return module is not idemflow.edge and any(
        getattr(idemflow.edge, name) is found for name in idemflow.edge.__all__
    )


def test_every_public_name_has_an_api_reference_entry(site: Path) -> None:
    documented = anchors(site)
    missing = []
    for name in public_modules():
        module = importlib.import_module(name)
        if name not in documented:
            missing.append(name)
        missing += [
            f"{name}.{member}"
            for member in getattr(module, "__all__", [])
            if f"{name}.{member}" not in documented and not reexported_from_the_edge(module, member)
        ]
    assert missing == [], "not in docs/reference/: " + ", ".join(missing)


def test_the_api_reference_is_one_page_per_public_module(site: Path) -> None:
    """``reference/<module>/``: that module's entries and no other module's."""
    modules = public_modules()
    pages = {
        page.parent.name: set(re.findall(r'id="(idemflow[\w.]*)"', page.read_text()))
        for page in (site / "reference").glob("*/index.html")
    }
    assert sorted(pages) == sorted(modules)
    for module, found in pages.items():
        assert module in found, f"reference/{module}/ has no entry for the module itself"
        others = {m for m in found if m in modules and m != module}
        assert others == set(), f"reference/{module}/ documents {others} too"


def test_the_api_reference_lists_no_private_name(site: Path) -> None:
    """The other way round: a module's entries are its ``__all__`` and its submodules."""
    documented = anchors(site)
    modules = set(public_modules())
    extra = []
    for name in modules & documented:
        listed = set(getattr(importlib.import_module(name), "__all__", []))
        extra += [
            anchor
            for anchor in documented
            if anchor.startswith(f"{name}.")
            and "." not in anchor.removeprefix(f"{name}.")
            and anchor.removeprefix(f"{name}.") not in listed
            and anchor not in modules
        ]
    assert extra == [], "private names on the reference page: " + ", ".join(sorted(extra))


def test_every_problem_type_uri_names_a_page_of_the_site(site: Path) -> None:
    for slug in pages():
        uri = PROBLEM_BASE + slug
        path = uri.removeprefix("https://idemflow.dev/")
        assert (site / path / "index.html").is_file(), uri


#: The scenarios docs/core.md draws, one sequence diagram each (issue 13).
SCENARIOS = (
    "### First request",
    "### Concurrent duplicate: 409",
    "### Transient failure: the key is released",
    "### Crash after an external call: sweep and reconcile",
    "### Replay after retention: a new intent",
)


def sections(markdown: str) -> dict[str, str]:
    """Each ``###`` heading's text up to the next heading of any level."""
    found: dict[str, str] = {}
    for chunk in re.split(r"\n(?=#{2,3} )", markdown):
        heading, _, body = chunk.partition("\n")
        found[heading.strip()] = body
    return found


def test_the_state_machine_and_every_scenario_is_a_diagram(site: Path) -> None:
    core = (ROOT / "docs" / "core.md").read_text()
    assert "```mermaid\nstateDiagram-v2" in core
    by_heading = sections(core)
    for heading in SCENARIOS:
        assert heading in by_heading, f"docs/core.md has no {heading!r}"
        assert "```mermaid\nsequenceDiagram" in by_heading[heading], heading
    html = (site / "core" / "index.html").read_text()
    assert html.count('<pre class="mermaid">') >= 1 + len(SCENARIOS)


#: A Sphinx role (``:class:`X```) mkdocstrings would print as it is, colons and all.
UNRENDERED_ROLE = re.compile(r":(?:class|func|meth|data|attr|exc|mod|obj|const|py:\w+):(?=`|<code)")


def test_the_site_shows_no_unrendered_sphinx_role(site: Path) -> None:
    """Docstrings cross-reference in Markdown (`X` or [X][idemflow.X]), which renders."""
    found = {
        str(page.relative_to(site)): len(UNRENDERED_ROLE.findall(page.read_text()))
        for page in site.rglob("*.html")
    }
    assert {page: count for page, count in found.items() if count} == {}


def test_the_reference_shows_each_name_once_and_no_django_plumbing(site: Path) -> None:
    """EdgeOptions at its home only; the Django store's and transaction's side of the store
    contract (the driver's calls) is the protocol's entry, not a Django API."""
    from idemflow.integrations.flask import Idempotency

    documented = anchors(site)
    assert {a for a in documented if a.endswith(".EdgeOptions")} == {"idemflow.edge.EdgeOptions"}
    plumbing = ("claim_on_lent", "lend", "execute_and_commit")
    django = ("idemflow.integrations.django.", "idemflow.stores.django.")
    assert {a for a in documented if a.startswith(django) and a.endswith(plumbing)} == set()
    assert "idemflow.stores.django.DjangoStore.claim" in documented
    assert "idemflow.stores.protocol.Transaction.lend" in documented
    assert Idempotency.init_app.__doc__
    assert "idemflow.integrations.flask.Idempotency.init_app" in documented
    assert "idemflow.integrations.flask.Idempotency.state" not in documented
