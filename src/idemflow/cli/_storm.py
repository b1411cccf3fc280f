"""``idemflow storm``: the retry storm, which ships beside the library as ``idemflow_demo.storm``.

The library keeps only this loader. The command's arguments live in
:mod:`idemflow_demo.storm.cli` (argparse only); the storm, httpx and the demo it
attacks are imported only when the command runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register(subparsers: Any) -> None:
    from idemflow_demo.storm.cli import register as register_storm

    register_storm(subparsers)
