"""idemflow.audit: black-box checks of one Idempotency-Key endpoint over HTTP (or an ASGI or
WSGI app in process), judged only from what comes back. Imports httpx. See docs/audit.md."""

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
