"""
``import idemflow.client`` is light: httpx and requests come with the first name taken from them.

Checked in fresh interpreters, so nothing another test imported can hide a leak.
"""

from __future__ import annotations

import json
import subprocess
import sys

import idemflow.client

#: The client's optional dependencies, and what they pull in.
HEAVY = ("httpx", "httpcore", "anyio", "requests", "urllib3", "h11")


def modules_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".", 1)[0] in HEAVY]


def test_importing_the_client_imports_neither_httpx_nor_requests() -> None:
    assert heavy(modules_after("import idemflow, idemflow.client")) == []
    policy_only = "from idemflow.client import RetryPolicy, KeyForm, outcome, replayed"
    assert heavy(modules_after(policy_only)) == []


def test_each_transport_imports_only_its_library() -> None:
    with_httpx = heavy(modules_after("from idemflow.client import IdempotentTransport"))
    assert "httpx" in with_httpx
    assert not [m for m in with_httpx if m.startswith(("requests", "urllib3"))]
    with_requests = heavy(modules_after("from idemflow.client import IdempotentAdapter"))
    assert "requests" in with_requests
    assert not [m for m in with_requests if m.startswith(("httpx", "httpcore"))]


def test_a_missing_library_says_which_extra_to_install() -> None:
    """httpx absent (blocked in sys.modules): the ImportError names the extra."""
    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "try:\n    from idemflow.client import AsyncIdempotentTransport\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "needs httpx: pip install 'idemflow[client]'" in done.stdout


def test_the_public_names_resolve() -> None:
    missing = [name for name in idemflow.client.__all__ if not hasattr(idemflow.client, name)]
    assert missing == []
    assert len(set(idemflow.client.__all__)) == len(idemflow.client.__all__)
