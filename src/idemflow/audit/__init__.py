"""
idemflow.audit: black-box conformance checks of one Idempotency-Key endpoint over HTTP.

The checks (their names are an interface: ``CHECKS``) send real requests to a
URL, or in process to an ASGI or WSGI app, and judge only from what comes back
(and, given a count URL, from how many times the effect ran), so the API may be
written in any language. ``idemflow audit URL`` is the same on the command line.
See ``docs/audit.md``.

Importing this package imports httpx (``pip install 'idemflow[client]'``);
``import idemflow`` does not import it.
"""

from __future__ import annotations

# Not listed: the CLI's plan, and what a report holds (a result, never built by a caller).
from ._checks import CHECKS as CHECKS
from ._checks import CheckResult as CheckResult
from ._checks import Report as Report
from ._checks import audit, audit_async
from ._checks import plan as plan

__all__ = [
    "audit",
    "audit_async",
]
