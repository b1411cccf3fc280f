"""
The consumer storm behind ``idemflow consumer-storm``: exactly once, shown for a message
consumer under crashes (docs/consumers.md, "The consumer storm").

Producers publish every message to a Redis stream more than once (as a producer that
never saw its reply retries), consumer processes on `AsyncRedisStreams` are SIGKILLed at
random and restarted, and the broker itself (a private ``redis-server`` with
``appendonly``) is killed and restarted mid-run. Each message's effect is a row written
in the transaction its completion commits in (SQLite or PostgreSQL), so the verdict
counts effects per message: none twice, none missing, no claim or entry left over once
the sweeper has passed. Like the demo, it uses only idemflow's public API; nothing heavy
is imported until the storm runs.
"""

from __future__ import annotations
