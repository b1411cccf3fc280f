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

from ._checks import CHECKS, CheckResult, Report, audit, audit_async, plan

__all__ = ["CHECKS", "CheckResult", "Report", "audit", "audit_async", "plan"]
