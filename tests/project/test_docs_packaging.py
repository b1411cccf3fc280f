"""
What a team checks before adopting the package: a licence that matches the
metadata, a changelog with a versioning policy, project URLs, and one version
reported the same way by the metadata, ``idemflow.__version__`` and the CLI.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import idemflow

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SCRIPT = Path(sys.executable).with_name("idemflow")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "idemflow"]


def test_the_licence_file_is_the_licence_the_metadata_names() -> None:
    assert PYPROJECT["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert 'THE SOFTWARE IS PROVIDED "AS IS"' in text


def test_the_version_has_one_source() -> None:
    """pyproject.toml says it; the installed metadata, ``__version__`` and the CLI repeat it."""
    declared = PYPROJECT["version"]
    assert metadata.version("idemflow") == declared
    assert idemflow.__version__ == declared
    done = subprocess.run(
        [*COMMAND, "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == f"idemflow {declared}"


def test_the_project_urls_point_at_the_docs_site() -> None:
    urls = PYPROJECT["urls"]
    assert {"Homepage", "Documentation", "Changelog"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())


def test_the_changelog_keeps_an_unreleased_section_and_names_its_policy() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert "docs/versioning.md" in text
    policy = (ROOT / "docs" / "versioning.md").read_text()
    assert "## Deprecation" in policy
    assert "DeprecationWarning" in policy
