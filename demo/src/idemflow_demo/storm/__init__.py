"""
The retry storm behind ``idemflow storm``: exactly once, shown under crashes.

Many keys, several concurrent clients per key that honour ``Retry-After``,
a provider that fails now and then, and a server SIGKILLed at random moments
and restarted on the same database. At the end the clients' answers are set
against the service's payments and the provider's ledger; see
``docs/storm.md``. Needs the demo's distribution (``demo/``: httpx, and the demo it attacks).
Like the demo, it uses only idemflow's public API.

Importing this package imports nothing heavy: ``idemflow --help`` registers
the command's arguments from :mod:`idemflow_demo.storm.cli`, and httpx comes
with the first name taken from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import StormConfig
    from .run import StormResult, run_storm
    from .verdict import Verdict

__all__ = ["StormConfig", "StormResult", "Verdict", "run_storm"]

_MODULES = {"StormConfig": "config", "StormResult": "run", "Verdict": "verdict", "run_storm": "run"}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
