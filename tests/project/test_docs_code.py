"""
Every ```python block in README.md and docs/ is compiled, type-checked and, when
it is a whole program, run: a renamed argument or a removed name in the API
fails here, not in a reader's terminal.

What a block is, is said by an HTML comment on the line before its fence
(invisible on the site and on GitHub); without one, a block is ``run``:

``<!-- docs-code: run -->`` (the default)
    a whole program: type-checked, then run in a fresh interpreter in an empty
    temporary directory; it must exit 0 (assert what it shows).
``<!-- docs-code: pytest -->``
    a test module: type-checked, then run with pytest; every test must pass.
``<!-- docs-code: typecheck -->``
    a whole program that needs what is not here (a server at a made-up
    address, an app that serves forever): type-checked, not run.
``<!-- docs-code: fragment -->``
    part of a larger program (names it uses come from around it): compiled
    and type-checked with undefined names and modules that do not exist
    allowed (they are ``Any``), so what it does with idemflow's own names is
    still checked.

Type checks are mypy's ``check_untyped_defs`` (a doc's functions need not be
annotated), with the project's settings for untyped dependencies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODES = ("run", "pytest", "typecheck", "fragment")
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
MARKER = re.compile(r"<!--\s*docs-code:\s*(?P<mode>[\w-]+)\s*-->\s*$")
TIMEOUT = 120
#: A fragment may use names from around it and import a module it stands for.
FRAGMENT_HEADER = '# mypy: disable-error-code="name-defined, import-not-found"\n'


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the opening fence
    mode: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def module(self) -> str:
        """A module name unique to this block (mypy reports errors per file)."""
        return "block_" + re.sub(r"\W", "_", self.page.removesuffix(".md")) + f"_L{self.line}"


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for fence in FENCE.finditer(text):
        before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        mode = marker["mode"] if marker else "run"
        assert mode in MODES, f"{path.name}: unknown docs-code mode {mode!r} (one of {MODES})"
        indent = len(fence["indent"])
        code = "\n".join(line[indent:] for line in fence["body"].splitlines()) + "\n"
        line = text[: fence.start()].count("\n") + 1
        found.append(Block(str(path.relative_to(ROOT)), line, mode, code))
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def mypy_config(path: Path) -> None:
    """The project's settings for untyped dependencies; check_untyped_defs, not strict."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = [
        "[mypy]",
        "python_version = 3.11",
        f"mypy_path = {ROOT / 'src'}",
        "check_untyped_defs = True",
        "warn_unused_ignores = True",
        "show_error_codes = True",
    ]
    for override in project.get("overrides", []):
        if override.get("ignore_missing_imports"):
            lines += [f"[mypy-{','.join(override['module'])}]", "ignore_missing_imports = True"]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("docs-code")
    for block in BLOCKS:
        header = FRAGMENT_HEADER if block.mode == "fragment" else ""
        (where / f"{block.module}.py").write_text(header + block.code)
    return where


@pytest.fixture(scope="module")
def type_errors(workdir: Path) -> dict[str, list[str]]:
    """mypy over every block at once: module name -> its error lines."""
    config = workdir / "mypy.ini"
    mypy_config(config)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(ROOT / ".venv" / ".mypy-docs-cache"),
            "--no-error-summary",
            *sorted(str(p) for p in workdir.glob("block_*.py")),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    errors: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        name = Path(line.split(":", 1)[0]).stem
        if ": error:" in line:
            errors.setdefault(name, []).append(line)
    return errors


def test_every_block_is_found() -> None:
    assert len(BLOCKS) >= 30  # the README and the guides' examples
    assert {block.mode for block in BLOCKS} >= {"run", "typecheck", "fragment"}


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_a_block_compiles_and_type_checks(block: Block, type_errors: dict[str, list[str]]) -> None:
    compile(block.code, block.id, "exec")
    assert type_errors.get(block.module, []) == [], f"{block.id} ({block.mode})"


RUNNABLE = [block for block in BLOCKS if block.mode in ("run", "pytest")]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_a_whole_program_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / f"{block.module}.py"
    script.write_text(block.code)
    if block.mode == "pytest":
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        command = [sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False
    )
    assert done.returncode == 0, f"{block.id}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
