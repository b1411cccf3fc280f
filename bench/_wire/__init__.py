"""Round-trip counting for the servers a benchmark starts (see ``sitecustomize.py``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["read_counts", "wire_env"]

HERE = Path(__file__).resolve().parent


def wire_env(directory: Path) -> dict[str, str]:
    """Environment for a child process that counts its round trips into ``directory``."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "IDEMFLOW_BENCH_WIRE": str(directory)}


def read_counts(directory: Path) -> tuple[int, int]:
    """PostgreSQL and Redis round trips so far, summed over every process's file."""
    postgres = redis = 0
    for path in directory.glob("*.count"):
        fields = path.read_text().split()
        if len(fields) >= 2:
            postgres += int(fields[0])
            redis += int(fields[1])
    return postgres, redis
