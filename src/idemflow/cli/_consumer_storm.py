"""``idemflow consumer-storm``: the loader of the consumer storm's command
(`idemflow_demo.consumer_storm.cli`)."""

from __future__ import annotations

from typing import Any

from ._common import register_from_the_demo


def register(subparsers: Any) -> None:
    register_from_the_demo(subparsers, "idemflow_demo.consumer_storm.cli", "consumer-storm")
