"""What a pooled connection's socket says while the connection sits idle."""

from __future__ import annotations

import select

__all__ = ["readable_now"]


def readable_now(fd: int) -> bool:
    """Is there something to read on ``fd``, without waiting? An idle connection is sent
    nothing but, rarely, a notice, and the server's goodbye."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # Windows
