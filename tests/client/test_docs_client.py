"""
The code in docs/client.md runs: each block, against the real demo where it sends.

``https://api.example`` in the examples becomes the demo's URL; the examples
send no bearer token, so the demo answers 401, a settled answer the client
returns at once: the blocks run end to end, through the real transports.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from idemflow.client import ClientOutcome
from tests.http.conftest import Demo, demo

__all__ = ["demo"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def run(block: str, url: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_client"}
    exec(compile(block.replace("https://api.example", url), str(DOC), "exec"), namespace)
    return namespace


def test_the_page_has_the_blocks_this_test_runs() -> None:
    assert len(BLOCKS) == 5


def test_the_httpx_example(demo: Demo) -> None:
    done = run(BLOCKS[0], demo.url)["done"]
    assert isinstance(done, ClientOutcome)
    assert (done.status, done.attempts) == (401, 1)


def test_the_async_example(demo: Demo) -> None:
    pay = run(BLOCKS[1], demo.url)["pay"]
    assert asyncio.run(pay()) is False


def test_the_requests_example(demo: Demo) -> None:
    namespace = run(BLOCKS[2], demo.url)
    assert namespace["response"].status_code == 401
    assert namespace["done"].key
    namespace["session"].close()
    namespace["mine"].close()


def test_the_settings_example(demo: Demo) -> None:
    namespace = run(BLOCKS[3], demo.url)
    assert namespace["policy"].key_factory().startswith("pay-")
    assert namespace["transport"] is not None


def test_the_key_after_an_error_example(demo: Demo) -> None:
    """The demo answers (401): no error; test_hostile_answers.py raises one."""
    run(BLOCKS[4], demo.url)
