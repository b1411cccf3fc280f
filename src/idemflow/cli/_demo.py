"""``idemflow demo``: the demo payments service, shipped beside the library as ``idemflow_demo``.

The library keeps only this loader. The command's arguments live in
:mod:`idemflow_demo.cli` (argparse and the demo's settings, nothing heavy), and
the app with Starlette and uvicorn is imported only when the command runs, so
``idemflow --help`` and the other commands stay fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    from idemflow_demo.cli import register as register_demo

    register_demo(subparsers)
