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


#: The example apps a user's strict type checker should find strict: idemflow gives them
#: no ``Any`` (``idem.connection`` is the request's ``AsyncSession``; ``@idem.protect``
#: keeps the view's parameters). The Django example is left out: Django has no types.
TYPED_EXAMPLES = ["fastapi_app.py", "flask_app/app.py", "wsgi_app.py", "quickstart.py"]


def test_the_examples_type_check_strictly_with_no_function_made_any() -> None:
    """``mypy --strict`` and ``--disallow-any-decorated``: a decorator of idemflow's that
    erased a view's signature would make it ``Any`` and fail here. Base classes from
    untyped packages (Flask-Login's ``UserMixin``) are theirs, allowed."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--disallow-any-decorated",
            "--allow-subclassing-any",
            "--no-error-summary",
            *(str(EXAMPLES / name) for name in TYPED_EXAMPLES),
        ],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
