"""
The demo payments service behind ``idemflow demo``.

``POST /payments`` with an ``Idempotency-Key`` charges a fake external
provider once, however often the client retries; see ``docs/demo.md``.
Importing this package imports nothing heavy: the app lives in
:mod:`idemflow_demo.app` (Starlette, uvicorn, prometheus-client), the retry
storm in :mod:`idemflow_demo.storm`.

It is its own distribution (``idemflow-demo``, ``demo/``), outside the library's
wheel, and uses only idemflow's public API (``tests/project/test_demo_public_api.py``
checks every import):
what it needs is what an application needs. The test-only fault injection
(:mod:`idemflow_demo.faults`) and the benchmark-only route live here, never in
the library.
"""

from .settings import DEFAULT_TOKENS, Settings, parse_duration

__all__ = ["DEFAULT_TOKENS", "Settings", "parse_duration"]
