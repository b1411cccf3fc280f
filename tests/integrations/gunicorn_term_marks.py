"""
A gunicorn config file for the SIGTERM tests (``gunicorn -c``): a worker that handles
SIGTERM (the master's graceful stop) begins its graceful shutdown as before, then
creates ``<its log file>.term-<pid>``. Once that file exists the worker is draining:
it accepts nothing more and gives the requests in flight the graceful timeout.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any


def term_mark(log: Path, pid: int) -> Path:
    """The file worker ``pid`` of the server logging to ``log`` creates on SIGTERM."""
    return log.with_name(f"{log.name}.term-{pid}")


def post_worker_init(worker: Any) -> None:
    """gunicorn's hook, once the worker has installed its signal handlers."""

    def handle_exit(sig: int, frame: FrameType | None) -> None:
        worker.handle_exit(sig, frame)  # draining from here on
        term_mark(Path(worker.cfg.errorlog), os.getpid()).touch()

    signal.signal(signal.SIGTERM, handle_exit)
