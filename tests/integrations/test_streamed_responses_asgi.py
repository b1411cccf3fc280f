"""
A streamed answer through the ASGI doors, once the endpoint has run (the WSGI doors are in
test_streamed_responses.py): Starlette's ``Idempotent`` and FastAPI's ``IdempotentRoute``
run the endpoint in the transaction the completion is written in, so a body that cannot
be stored rolls its row back and releases the key; the ASGI middleware reads the body to
its end and stores it. Three requests with one key: the effect committed at most once, and
where it committed the key settled, never released.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest

from idemflow import AsyncIdempotency, Policy, State
from tests.backends import open_rig

pytest.importorskip("starlette")

POLICY = Policy(request_timeout=5)
KINDS = ["streamed", "file", "generator", "sse"]
DOORS = ["starlette-middleware", "starlette-idempotent", "fastapi"]


def starlette_answer(kind: str, tmp_path: Path) -> Any:
    """What an endpoint returns for ``kind``: each one a body Starlette streams."""
    from starlette.responses import FileResponse, StreamingResponse

    async def events() -> Any:
        yield b"data: charged\n\n"
        yield b"data: done\n\n"

    if kind == "streamed":
        return StreamingResponse(iter([b"charged"]), status_code=201)
    if kind == "file":
        receipt = tmp_path / "receipt.txt"
        receipt.write_bytes(b"receipt")
        return FileResponse(receipt, media_type="text/plain")
    if kind == "generator":
        return StreamingResponse(events(), status_code=201)
    return StreamingResponse(events(), media_type="text/event-stream")


def make_app(door: str, kind: str, rig: Any, tmp_path: Path) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route

    from idemflow.integrations.starlette import IdempotencyMiddleware, Idempotent

    idempotency = AsyncIdempotency(rig.store, POLICY)
    if door == "starlette-middleware":

        async def charge(request: Request) -> Any:  # declares nothing: refused by no check
            await rig.charge(request.headers["idempotency-key"])
            return starlette_answer(kind, tmp_path)

        return IdempotencyMiddleware(
            Starlette(routes=[Route("/payments", charge, methods=["POST"])]),
            idempotency=idempotency,
            endpoints=["POST /payments"],
            principal=lambda scope: "alice",
        )
    idempotent = Idempotent(
        idempotency, connect=rig.connect, transaction=rig.adapter, principal=lambda scope: "alice"
    )
    if door == "starlette-idempotent":

        async def pay(request: Request) -> Any:
            async def handler(attempt: Any) -> Any:
                await rig.write(attempt.connection, request.headers["idempotency-key"])
                return starlette_answer(kind, tmp_path)

            return await idempotent.run(request, handler)

        return Starlette(routes=[Route("/payments", pay, methods=["POST"])])

    from fastapi import APIRouter, Depends, FastAPI
    from fastapi import Request as FastAPIRequest

    from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency

    def alice() -> str:
        return "alice"

    Idem = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=alice))]
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/payments")
    async def create(request: FastAPIRequest, idem: Idem) -> Any:
        await rig.write(idem.connection, request.headers["idempotency-key"])
        return starlette_answer(kind, tmp_path)

    app = FastAPI()
    app.include_router(router)
    return app


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("door", DOORS)
async def test_every_asgi_door_runs_a_streamed_endpoint_at_most_once_to_effect(
    door: str, kind: str, tmp_path: Path, table_name: str
) -> None:
    """A streamed body, a file, an async generator, server-sent events. Transactional
    (``Idempotent``, FastAPI's route): the 500 ``response-not-storable`` problem, the row
    rolled back, the key released; no run's row ever committed. Middleware: the body read
    whole, stored and replayed; the charge made once, the key settled."""
    if door == "fastapi":
        pytest.importorskip("fastapi")
    transactional = door != "starlette-middleware"
    async with open_rig("sqlite", table_name, tmp_path, transactional=transactional) as rig:
        app = make_app(door, kind, rig, tmp_path)
        key = f"k-{door}-{kind}"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            answers = [
                await client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": key})
                for _ in "123"
            ]
        state = rig.peek(key)
        notes = rig.notes()

    if transactional:
        assert notes == []
        assert state is State.RELEASED
        for answer in answers:
            assert answer.status_code == 500
            assert answer.json()["type"].endswith("/response-not-storable")
        return
    assert notes == [key]
    assert state is State.COMPLETED
    first, *retries = answers
    assert first.content in (b"charged", b"receipt", b"data: charged\n\ndata: done\n\n")
    for retry in retries:
        assert (retry.status_code, retry.content) == (first.status_code, first.content)
        assert retry.headers["idempotent-replayed"] == "true"
