"""What a pooled connection's socket says while the connection sits idle."""

from __future__ import annotations

import select

__all__ = ["readable_now"]


def readable_now(fd: int) -> bool:
    """Is there something to read on ``fd``, without waiting? One ``poll(2)`` (any fd
    number; ``select`` where there is no ``poll``).

    An idle database connection is sent nothing but, rarely, a notification, and the
    server's goodbye when it closes the connection (its last message, then end of file):
    readable is the cue to ask it before handing it out.
    """
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # Windows
