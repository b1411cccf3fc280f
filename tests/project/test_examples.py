"""The scripted example in examples/ runs and tells the truth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_charges_once_and_refuses_the_reused_key() -> None:
    """503 released, then 201, then the 201 replayed, then 422; one payment in the end."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stdout.splitlines()

    assert "  -> 503" in lines[1]
    assert "  -> 201" in lines[3]
    assert lines[5].endswith("(replayed)")
    assert "  -> 422" in lines[7]
    assert lines[-1] == "payments in the database: 1"
