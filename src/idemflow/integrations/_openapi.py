"""The OpenAPI description of a protected operation (the key header, the problems, the
replay headers) as plain dictionaries, written once for FastAPI and drf-spectacular."""

from __future__ import annotations

import copy
from typing import Any

from ..edge import (
    ORIGINAL_REQUEST_ID_HEADER,
    PROBLEM_CONTENT_TYPE,
    REPLAYED_HEADER,
    REQUEST_ID_HEADER,
)

_PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An RFC 9457 problem (https://idemflow.dev/problems/<slug>).",
    "required": ["type", "title", "status", "detail", "retryable"],
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "retryable": {
            "type": "boolean",
            "description": "Whether the same request, unchanged, may be sent again.",
        },
    },
    "additionalProperties": True,
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer", "minimum": 0},
    }
}
_PROBLEMS: dict[str, tuple[str, bool]] = {
    "400": (
        "`missing-key`, `invalid-key`: no or a malformed Idempotency-Key; `invalid-body`, "
        "`incomplete-body`: a body that cannot be fingerprinted or did not arrive whole. "
        "Nothing was recorded.",
        False,
    ),
    "401": ("`missing-principal`: authenticate first; keys are scoped to the caller.", False),
    "409": (
        "`in-progress`: the first request with this key is still running; retry after "
        "`Retry-After` seconds with the same key. `lease-lost`: the claim was taken over.",
        True,
    ),
    "413": ("`body-too-large`: the body is over the limit for idempotent requests.", False),
    "422": (
        "`key-reused`: this Idempotency-Key was first used for a different request (body, "
        "method, route, path parameters or query string).",
        False,
    ),
    "503": (
        "`store-unavailable`: the idempotency key store cannot be reached; retry after "
        "`Retry-After` seconds with the same key.",
        True,
    ),
}


def operation(success: str, *, required: bool = True, also_422: str = "") -> dict[str, Any]:
    """What an operation protected by idemflow adds to its OpenAPI description: the
    ``Idempotency-Key`` parameter, the problem answers, the replay headers of the
    ``success`` status; ``also_422``: what else the framework answers 422 for."""
    problem = {PROBLEM_CONTENT_TYPE: {"schema": copy.deepcopy(_PROBLEM_SCHEMA)}}
    responses: dict[str, Any] = {success: {"headers": _replay_headers()}}
    for status, (description, retry) in _PROBLEMS.items():
        said = f"{also_422}, or {description}" if status == "422" and also_422 else description
        answer: dict[str, Any] = {"description": said, "content": copy.deepcopy(problem)}
        if retry:
            answer["headers"] = copy.deepcopy(_RETRY_AFTER)
        responses[status] = answer
    key = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": required,
        "description": (
            "A unique key per operation (1-255 printable ASCII characters, bare or as an "
            "RFC 9651 quoted string). Retrying with the same key and the same request "
            "returns the first response instead of running it again."
            + ("" if required else " Optional: without one the request runs unprotected.")
        ),
        "schema": {"type": "string", "minLength": 1},
    }
    return {"parameters": [key], "responses": responses}


def _replay_headers() -> dict[str, Any]:
    return {
        _title_case(REPLAYED_HEADER): {
            "description": "`true` when this is the stored response of an earlier request "
            "with the same key, replayed (the endpoint did not run again).",
            "schema": {"type": "string", "enum": ["true"]},
        },
        _title_case(ORIGINAL_REQUEST_ID_HEADER): {
            "description": "On a replay: the X-Request-Id of the request that produced it.",
            "schema": {"type": "string"},
        },
        _title_case(REQUEST_ID_HEADER): {
            "description": "This request's correlation id.",
            "schema": {"type": "string"},
        },
    }


def _title_case(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))
