"""``idemflow storm``: the retry storm, ``idemflow_demo.storm`` in the demo's distribution.

The library keeps only this loader. The command's arguments live in
`idemflow_demo.storm.cli` (argparse only); the storm, httpx and the demo it
attacks are imported only when the command runs.
"""

from __future__ import annotations

from typing import Any

from ._common import register_from_the_demo

__all__ = ["register"]


def register(subparsers: Any) -> None:
    register_from_the_demo(subparsers, "idemflow_demo.storm.cli", "storm")
