"""``idemflow demo``: the demo payments service, the distribution ``idemflow-demo`` (``demo/``).

The library keeps only this loader. The command's arguments live in
:mod:`idemflow_demo.cli` (argparse and the demo's settings, nothing heavy), and
the app with Starlette and uvicorn is imported only when the command runs, so
``idemflow --help`` and the other commands stay fast.
"""

from __future__ import annotations

from typing import Any

from ._common import DEMO_INSTALL, add_not_installed

__all__ = ["register"]


def register(subparsers: Any) -> None:
    try:
        from idemflow_demo.cli import register as register_demo
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("idemflow_demo"):
            raise
        add_not_installed(subparsers, "demo", DEMO_INSTALL)
        return
    register_demo(subparsers)
