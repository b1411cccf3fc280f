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
    """Round trips (PostgreSQL, Redis, MySQL together) and pool checkouts so far, every process."""
    trips = checkouts = 0
    for path in directory.glob("*.count"):
        fields = [int(field) for field in path.read_text().split()]
        if len(fields) >= 4:
            trips += fields[0] + fields[1] + fields[3]
            checkouts += fields[2]
    return trips, checkouts
