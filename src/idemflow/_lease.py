"""
Lease tokens: unique per claim, cheap to make.
A token only fences writes, so it need only be unique: a random per-process prefix
(drawn again at fork) plus a counter, not ``os.urandom`` per claim (~15 µs).
"""

from __future__ import annotations

import itertools
import os

__all__ = ["new_lease_token"]

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter  # noqa: PLW0603 -- one process-wide sequence, by design
    _prefix = os.urandom(12).hex()
    _counter = itertools.count()


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_lease_token() -> str:
    """A token no other claim, in this process or any other, has had."""
    # count() is atomic under the GIL; the prefix's fixed length keeps tokens distinct.
    return _prefix + str(next(_counter))
