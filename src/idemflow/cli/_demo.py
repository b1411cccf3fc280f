"""``idemflow demo``: the loader of the demo service's command (`idemflow_demo.cli`)."""

from __future__ import annotations

from typing import Any

from ._common import register_from_the_demo


def register(subparsers: Any) -> None:
    register_from_the_demo(subparsers, "idemflow_demo.cli", "demo")
