"""
TEST-ONLY fault injection: the demo kills itself at a chosen point of a payment.

Off unless the environment variable ``IDEMFLOW_DEMO_CRASH_AT`` is set when
the server starts; nothing here runs otherwise. The crash tests
(``tests/guarantees/crash/``) set it to one of :data:`CRASH_POINTS` to put a real
server process down exactly where a crash hurts most:

- ``after_claim``: the claim committed, nothing else did;
- ``after_charge``: the provider charged, the local commit did not happen;
- ``after_commit``: the payment and the completion committed, the response
  was never sent.

``SIGKILL`` and not an exception: no ``finally``, no rollback, no shutdown
hook runs, as when the machine loses power or the kernel's OOM killer strikes.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_POINTS", "crash_point"]

CRASH_POINTS = ("after_claim", "after_charge", "after_commit")

# Read once at import: the variable is the test's instruction to this process.
_CRASH_AT = os.environ.get("IDEMFLOW_DEMO_CRASH_AT")

if _CRASH_AT is not None and _CRASH_AT not in CRASH_POINTS:
    msg = f"IDEMFLOW_DEMO_CRASH_AT must be one of {', '.join(CRASH_POINTS)}, got {_CRASH_AT!r}"
    raise RuntimeError(msg)


def crash_point(point: str) -> None:
    """TEST-ONLY: SIGKILL this process if ``IDEMFLOW_DEMO_CRASH_AT`` names ``point``."""
    if point == _CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)
