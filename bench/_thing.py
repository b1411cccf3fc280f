"""
What the minimal endpoint answers, in idemflow's app and in every peer's: one place.

The created thing's id numbers the executions of the process, so from outside a replay
(the same id) and a second execution (a new one) tell apart. Starlette's request and
responses only, which every peer's Starlette (0.16 to 1.x) has.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

_EXECUTIONS = itertools.count(1)


def thing(order: dict[str, Any]) -> dict[str, Any]:
    """The created thing for the parsed request body ``order``."""
    return {"id": f"thing_{next(_EXECUTIONS)}", "amount": order["amount"]}


async def create(request: Request) -> JSONResponse:
    """``POST /things``: the JSON body parsed, 201 and the thing."""
    return JSONResponse(thing(json.loads(await request.body())), status_code=201)


async def health(request: Request) -> PlainTextResponse:
    """``GET /``: what the bench waits for before it starts."""
    return PlainTextResponse("ok")
