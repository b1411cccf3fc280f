"""``idemflow demo``: the demo payments service, the distribution ``idemflow-demo`` (``demo/``).

The library keeps only this loader. The command's arguments live in
`idemflow_demo.cli` (argparse and the demo's settings, nothing heavy), and
the app with Starlette and uvicorn is imported only when the command runs, so
``idemflow --help`` and the other commands stay fast.
"""

from __future__ import annotations

from typing import Any

from ._common import register_from_the_demo

__all__ = ["register"]


def register(subparsers: Any) -> None:
    register_from_the_demo(subparsers, "idemflow_demo.cli", "demo")
