"""
Powertools for AWS Lambda (Python) 3.37.0, idempotency utility on Redis, outside Lambda.

Powertools makes a function idempotent on a payload, not an HTTP endpoint: ``POST /things``
builds the payload ``{"idempotency_key": <Idempotency-Key header>, "body": <parsed JSON>}`` and
calls a function decorated with ``idempotent_function(data_keyword_argument="event", ...)``,
``IdempotencyConfig(event_key_jmespath="idempotency_key")`` and
``RedisCachePersistenceLayer(url=BENCH_URL)`` (the deprecated name of ``CachePersistenceLayer``,
the same class: a synchronous redis-py client, ``SET NX`` of an in-progress JSON record, then a
``SET`` of the completed one; records expire after 1 h). The function returns ``{"status": 201,
"body": {...}}``, which Powertools stores and replays; the endpoint turns it into a
``JSONResponse``: a replay has the same status, headers and JSON (keys sorted, as Powertools
stores the result with ``sort_keys``), with no replay marker. The utility is synchronous, so the
function runs in Starlette's thread pool (as FastAPI runs a sync endpoint). Keys are
``<BENCH_PREFIX>#<md5 of the key>`` (``key_prefix``). ``IdempotencyAlreadyInProgressError`` is
answered 409 (no waiting). No fingerprint: payload validation (``payload_validation_jmespath``)
is unusable on this layer in 3.37.0 — the completed record is written without the validation
hash, so every retry of a completed key raises ``IdempotencyValidationError`` — so a retry with
another body gets the first response. Without a Lambda context the in-progress record has no
in-progress expiry: a request that dies mid-way blocks its key (409) until the record expires.
Without a key, Powertools warns and runs the function unprotected. ``boto3`` must be installed:
the idempotency package imports its DynamoDB layer.
"""

from __future__ import annotations

import json
import os
from typing import Any

from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.exceptions import IdempotencyAlreadyInProgressError
from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
    RedisCachePersistenceLayer,
)
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bench._thing import create, health, thing

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")

persistence = RedisCachePersistenceLayer(url=URL)
config = IdempotencyConfig(event_key_jmespath="idempotency_key")


@idempotent_function(
    data_keyword_argument="event", persistence_store=persistence, config=config, key_prefix=PREFIX
)
def create_thing(event: dict[str, Any]) -> dict[str, Any]:
    return {"status": 201, "body": thing(event["body"])}


async def create_idempotent(request: Request) -> JSONResponse:
    event = {
        "idempotency_key": request.headers.get("idempotency-key"),
        "body": json.loads(await request.body()),
    }
    try:
        result = await run_in_threadpool(create_thing, event=event)
    except IdempotencyAlreadyInProgressError:
        return JSONResponse({"detail": "a request with this key is in progress"}, status_code=409)
    return JSONResponse(result["body"], status_code=result["status"])


app = Starlette(
    routes=[
        Route("/", health),
        Route("/things", create_idempotent, methods=["POST"]),
        Route("/plain/things", create, methods=["POST"]),
    ],
)
