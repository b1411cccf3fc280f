"""
A small reference Idempotency-Key endpoint for ``tests/core/test_audit.py``, and its
deliberately broken variants: a mutation test of ``idemflow audit`` itself.

``POST /things`` (``Authorization: Bearer alice|bob``) with a JSON body runs once
per (principal, key): 201 with ``{"id", "n", "principal"}`` and a ``Location``;
a body with ``"slow": true`` takes a second. Its downstream fails the very first
call once (503, nothing charged), so the kit's retry of a first request meets a
released key. ``GET /count`` counts executions. An in-memory dict is the store:
claiming is one dict write with no ``await`` between the look and the write.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]

PRINCIPALS = {"Bearer alice": "alice", "Bearer bob": "bob"}
KEY = re.compile(r"[A-Za-z0-9._:-]{1,255}")
#: The check-then-act variant's window between the look and the write.
RACE_WINDOW_SECONDS = 0.05
SLOW_SECONDS = 1.0


@dataclass
class Record:
    fingerprint: str
    answer: Answer | None = None


@dataclass
class Reference:
    """The reference endpoint; each flag off (or on) is one defect."""

    atomic_claim: bool = True  # False: look, then (after an await) write
    scoped_by_principal: bool = True  # False: one key space for every caller
    replays_completed: bool = True  # False: a completed key answers 409
    releases_transient: bool = True  # False: a 503 is stored and replayed
    replays_bytes: bool = True  # False: a replay re-serialises the stored JSON
    fingerprints: bool = True  # False: the body is not compared
    #: A busy server: the first slow request waits this long before it claims.
    first_slow_claim_delay: float = 0.0
    records: dict[Any, Record] = field(default_factory=dict)
    executions: int = 0
    downstream_failed_once: bool = False

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # under uvicorn: nothing to start or stop
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, headers, content = await self.answer(scope, body)
        headers = [*headers, (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def answer(self, scope: Message, body: bytes) -> Answer:
        if scope["method"] == "GET" and scope["path"] == "/count":
            return json_answer(200, {"executions": self.executions})
        if scope["method"] != "POST" or scope["path"] != "/things":
            return problem(404, "not found")
        headers = [(k.decode().lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        principal = PRINCIPALS.get(dict(headers).get("authorization", ""))
        if principal is None:
            return problem(401, "send Authorization: Bearer alice|bob")
        keys = [value for name, value in headers if name == "idempotency-key"]
        if not keys:
            return problem(400, "Idempotency-Key is required")
        if len(keys) > 1 or not KEY.fullmatch(keys[0]):
            return problem(400, "Idempotency-Key is malformed")
        try:
            value = json.loads(body)
        except ValueError:
            return problem(400, "the body is not JSON")
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
        fingerprint = hashlib.sha256(canonical.encode()).hexdigest() if self.fingerprints else ""
        where = (principal, keys[0]) if self.scoped_by_principal else keys[0]
        if isinstance(value, dict) and value.get("slow") and self.first_slow_claim_delay:
            delay, self.first_slow_claim_delay = self.first_slow_claim_delay, 0.0
            await asyncio.sleep(delay)  # the busy server's queue
        record = self.records.get(where)
        if record is None and not self.atomic_claim:
            await asyncio.sleep(RACE_WINDOW_SECONDS)  # the check-then-act window
        if record is None:
            record = self.records[where] = Record(fingerprint)
            return await self.execute(where, record, principal, value)
        return self.dispatch(record, fingerprint)

    def dispatch(self, record: Record, fingerprint: str) -> Answer:
        if record.fingerprint != fingerprint:
            return problem(422, "this key was used with another body")
        if record.answer is None or not self.replays_completed:
            return problem(409, "a request with this key is in progress", retry_after=1)
        status, headers, content = record.answer
        if not self.replays_bytes:
            content = json.dumps(json.loads(content), separators=(",", ":")).encode()
        return status, [*headers, (b"idempotent-replayed", b"true")], content

    async def execute(self, where: Any, record: Record, principal: str, value: Any) -> Answer:
        if isinstance(value, dict) and value.get("slow"):
            await asyncio.sleep(SLOW_SECONDS)  # the work a slow request does
        if not self.downstream_failed_once:
            self.downstream_failed_once = True
            failed = problem(503, "the downstream is unavailable", retry_after=0)
            if self.releases_transient:
                del self.records[where]
            else:
                record.answer = failed
            return failed
        self.executions += 1
        thing_id = uuid.uuid4().hex
        n = value.get("n") if isinstance(value, dict) else None
        status, headers, content = json_answer(
            201, {"id": thing_id, "n": n, "principal": principal}
        )
        record.answer = (status, [*headers, (b"location", f"/things/{thing_id}".encode())], content)
        return record.answer


def json_answer(status: int, value: Any) -> Answer:
    return status, [(b"content-type", b"application/json")], json.dumps(value).encode()


def problem(status: int, detail: str, retry_after: int | None = None) -> Answer:
    headers = [(b"content-type", b"application/problem+json")]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, json.dumps({"title": detail, "status": status}).encode()
