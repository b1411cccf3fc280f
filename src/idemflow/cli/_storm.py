"""``idemflow storm``: the retry storm, ``idemflow_demo.storm`` in the demo's distribution.

The library keeps only this loader. The command's arguments live in
:mod:`idemflow_demo.storm.cli` (argparse only); the storm, httpx and the demo it
attacks are imported only when the command runs.
"""

from __future__ import annotations

from typing import Any

from ._common import DEMO_INSTALL, add_not_installed

__all__ = ["register"]


def register(subparsers: Any) -> None:
    try:
        from idemflow_demo.storm.cli import register as register_storm
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("idemflow_demo"):
            raise
        add_not_installed(subparsers, "storm", DEMO_INSTALL)
        return
    register_storm(subparsers)
