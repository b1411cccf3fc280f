"""
The FastAPI example (examples/fastapi_app.py) under a real uvicorn, on
PostgreSQL: a first order, its byte-identical replay, another body under the
same key, and the key in the OpenAPI document.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import POSTGRES_URL, unreachable

pytestmark = pytest.mark.postgres
ROOT = Path(__file__).parents[2]


@pytest.fixture
def schema_url() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    schema = f"fastapi_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextlib.contextmanager
def example(database_url: str) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "uvicorn", "examples.fastapi_app:app", "--port", str(port)]
    env = {**os.environ, "FASTAPI_APP_DATABASE_URL": database_url}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/openapi.json", timeout=1, verify=False).status_code == 200:
                    break
            assert process.poll() is None, "the example did not start"
            assert time.monotonic() < deadline, "the example did not start in time"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_the_fastapi_example_charges_once_and_documents_the_key(schema_url: str) -> None:
    headers = {"authorization": "Bearer alice", "idempotency-key": "order-1"}
    order = {"item": "book", "quantity": 2}
    with example(schema_url) as url, httpx.Client(base_url=url, timeout=10, verify=False) as client:
        first = client.post("/orders", json=order, headers=headers)
        again = client.post("/orders", json=order, headers=headers)
        other = client.post("/orders", json={"item": "pen", "quantity": 1}, headers=headers)
        anonymous = client.post("/orders", json=order, headers={"idempotency-key": "order-2"})
        document = client.get("/openapi.json").json()

    assert first.status_code == 201
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert anonymous.status_code == 401
    parameters = document["paths"]["/orders"]["post"]["parameters"]
    assert any(p["name"].lower() == "idempotency-key" and p["in"] == "header" for p in parameters)
    assert "409" in document["paths"]["/orders"]["post"]["responses"]
