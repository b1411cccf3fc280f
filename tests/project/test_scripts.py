"""``scripts/test PATH`` runs just pytest on that path: no install, no lint, no types."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def executable(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def test_a_path_runs_just_pytest_on_it(tmp_path: Path) -> None:
    # A clone whose .venv has pytest but no ruff or mypy, and a bootstrap that
    # would fail: anything but pytest, called, fails the run.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test", tmp_path / "scripts" / "test")  # its mode too
    executable(tmp_path / "scripts" / "bootstrap", "echo bootstrap ran >&2; exit 1")
    executable(tmp_path / ".venv" / "bin" / "pytest", "exit 1")
    executable(tmp_path / ".venv" / "bin" / "python", 'echo "python $*"')

    done = subprocess.run(
        [tmp_path / "scripts" / "test", "tests/core/test_key.py", "-x"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "python -m pytest tests/core/test_key.py -x\n"
