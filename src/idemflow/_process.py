"""This process's id, kept current across forks.

What a process opened (a pool's connections, a thread's SQLite connection) is
its own: a forked child must open its own. The stores compare ``PID[0]`` on
every checkout or call; ``os.getpid()`` there would be a system call each time.
"""

from __future__ import annotations

import os

#: ``PID[0]`` is this process's id (a list, so that a fork can update it in place).
PID = [os.getpid()]


def _forked() -> None:
    PID[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)
