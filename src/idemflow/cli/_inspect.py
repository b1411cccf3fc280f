"""``idemflow inspect``: one key's record, as support needs to see it."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .._model import Record, is_past_retention
from ..logs import key_digest
from ._common import (
    add_database_arguments,
    add_json_argument,
    age,
    intermixed,
    iso,
    operated_store,
    print_json,
    print_pairs,
)

EXIT_NOT_FOUND = 3

PREVIEW_BYTES = 200
_LEASE_CHARS = 8
_FINGERPRINT_CHARS = 23  # "sha256:" and 16 hex digits


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = intermixed(
        subparsers.add_parser(
            "inspect",
            help="show the record of one key",
            description=(
                "Show what the store holds for one (principal, key): state, fingerprint, "
                "endpoint, lease, timestamps (ISO-8601 UTC), attempt count, recovery point, "
                "stored status and a preview of the body, and the correlation id that names "
                "the original request. An expired record is shown with expired: yes; the "
                "next claim treats it as absent."
            ),
            epilog=(
                f"exit status: 0 found, {EXIT_NOT_FOUND} no such record, "
                "1 error (unreachable store, missing table, bad URL)"
            ),
        )
    )
    add_database_arguments(parser)
    parser.add_argument("--principal", required=True, help="the principal that owns the key")
    parser.add_argument("key", metavar="KEY", help="the Idempotency-Key value")
    add_json_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with operated_store(args) as store:
        record: Record | None = store.get(args.principal, args.key)
    if record is None:
        if args.json:
            print_json({"found": False, "principal": args.principal, "key": args.key})
        print(
            f"idemflow inspect: no record for principal {args.principal!r} and key "
            f"{args.key!r} in {args.table}",
            file=sys.stderr,
        )
        return EXIT_NOT_FOUND
    described = describe_record(record, time.time())
    if args.json:
        print_json({"found": True, **described})
    else:
        title = f"{args.table}: principal {record.principal!r}, key {record.key!r}"
        print_pairs(title, [(name.replace("_", " "), value) for name, value in _human(described)])
    return 0


def describe_record(record: Record, now: float) -> dict[str, Any]:
    response = record.response
    return {
        "principal": record.principal,
        "key": record.key,
        "key_digest": key_digest(record.principal, record.key),
        "state": record.state.value,
        "endpoint": record.endpoint,
        "fingerprint": record.fingerprint,
        "lease_token": _short(record.lease_token, _LEASE_CHARS),
        "attempt": record.attempt,
        "recovery_point": record.recovery_point,
        "correlation_id": record.correlation_id,
        "created_at": iso(record.created_at),
        "updated_at": iso(record.updated_at),
        "expires_at": iso(record.expires_at),
        "age_seconds": round(now - record.created_at, 3),
        "idle_seconds": round(now - record.updated_at, 3),
        "expired": is_past_retention(record, now),
        "response": None
        if response is None
        else {
            "status": response.status,
            "headers": [list(pair) for pair in response.headers],
            "body_bytes": len(response.body),
            "body_binary": _is_binary(response.body),
            "body_preview": body_preview(response.body),
        },
    }


def body_preview(body: bytes, limit: int = PREVIEW_BYTES) -> str:
    """The first ``limit`` bytes: text with control characters escaped, or escaped bytes."""
    head = body[:limit]
    more = "…" if len(body) > limit else ""
    if _is_binary(body):
        return repr(head)[2:-1] + more
    text = head.decode("utf-8", errors="ignore")  # a cut mid-character drops it
    shown = (c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return "".join(shown) + more


def _is_binary(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _short(value: str | None, chars: int) -> str | None:
    if value is None or len(value) <= chars:
        return value
    return value[:chars] + "…"


def _human(described: dict[str, Any]) -> list[tuple[str, Any]]:
    pairs: list[tuple[str, Any]] = []
    for name, value in described.items():
        if name == "fingerprint":
            pairs.append((name, _short(value, _FINGERPRINT_CHARS)))
        elif name in ("age_seconds", "idle_seconds"):
            pairs.append((name.removesuffix("_seconds"), age(value)))
        elif name == "expired":
            pairs.append((name, "yes: the next claim treats it as absent" if value else "no"))
        elif name == "response":
            pairs.extend(_response_pairs(value))
        else:
            pairs.append((name, "-" if value is None else value))
    return pairs


def _response_pairs(response: dict[str, Any] | None) -> list[tuple[str, Any]]:
    if response is None:
        return [("response", "- (nothing stored: the request has not settled)")]
    kind = "binary, escaped" if response["body_binary"] else "text"
    headers = ", ".join(f"{k}: {v}" for k, v in response["headers"]) or "-"
    return [
        ("status", response["status"]),
        ("headers", headers),
        ("body", f"{response['body_bytes']} bytes ({kind})"),
        ("body preview", response["body_preview"] or "-"),
    ]
