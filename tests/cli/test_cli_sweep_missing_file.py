"""
``idemflow sweep`` on a SQLite path that does not exist: one line, a failing
exit status, and no file created (issue 9, defect 15).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def test_sweep_refuses_a_missing_sqlite_file_and_does_not_create_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    done = subprocess.run(
        [sys.executable, "-m", "idemflow", "sweep", f"sqlite:///{missing}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert not missing.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("idemflow sweep: no SQLite database at")
    assert "Traceback" not in done.stderr


def test_sweep_runs_on_an_existing_sqlite_file(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'keys.db'}"
    migrate = [sys.executable, "-m", "idemflow", "migrate", database]
    subprocess.run(migrate, capture_output=True, text=True, timeout=60, check=True)
    done = subprocess.run(
        [sys.executable, "-m", "idemflow", "sweep", database],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("swept idemflow_keys")
