"""
The retry storm behind ``idemflow storm``: exactly once, shown under crashes.

Many keys, several concurrent clients per key that honour ``Retry-After``,
a provider that fails now and then, and a server SIGKILLed at random moments
and restarted on the same database. At the end the clients' answers are set
against the service's payments and the provider's ledger; see
``docs/storm.md``. Needs ``idemflow[demo]`` (httpx, and the demo it attacks).
"""

from .config import StormConfig
from .run import StormResult, run_storm
from .verdict import Verdict

__all__ = ["StormConfig", "StormResult", "Verdict", "run_storm"]
