"""This process's id, kept current across forks, for stores that check at every checkout
that what they opened is this process's (``os.getpid()`` would be a system call each time)."""

from __future__ import annotations

import os

#: ``PID[0]`` is this process's id (a list, so that a fork can update it in place).
PID = [os.getpid()]


def _forked() -> None:
    PID[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)
