"""
Lease tokens: unique per claim, cheap to make.

A token only has to be unique (it fences writes; nobody guesses it), so it is
a random per-process prefix plus a counter. Calling ``os.urandom`` for every
claim cost ~15 µs a call on a loaded machine, the largest single item of a
replay's CPU. The prefix is drawn again in a forked child, so parent and
child can never hand out the same token.
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
    # next() on itertools.count is atomic under the GIL: no lock needed. The
    # prefix has a fixed length, so the plain decimal counter after it keeps
    # every token distinct (and costs less than a formatted one).
    return _prefix + str(next(_counter))
