"""
The demo payments service behind ``idemflow demo``.

``POST /payments`` with an ``Idempotency-Key`` charges a fake external
provider once, however often the client retries; see ``docs/demo.md``.
Importing this package imports nothing heavy: the app lives in
:mod:`idemflow.demo.app` (Starlette, uvicorn, prometheus-client).
"""

from .settings import DEFAULT_TOKENS, Settings, parse_duration

__all__ = ["DEFAULT_TOKENS", "Settings", "parse_duration"]
