"""``idemflow stats``: what a key table holds, what is stuck, what is due for purge."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .._model import Policy, State
from ..logs import key_digest
from ..stores.stats import StoreStats
from ._common import (
    add_database_arguments,
    add_json_argument,
    age,
    iso,
    operated_store,
    print_json,
    print_pairs,
    print_table,
)

_STATES = [state.value for state in State]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "stats",
        help="count records by state and endpoint; show stuck and expired ones",
        description=(
            "Count the key records by state and endpoint, show the oldest in_progress "
            "record and its age, how many in_progress records are older than the request "
            "timeout (crashed attempts: the stale-claims alert counts these) and than the "
            "sweeper's stale threshold derived from it, and how many records are past "
            "their retention but not purged yet. Counting by endpoint reads the whole "
            "table; the other figures use the state/age and expiry indexes."
        ),
    )
    add_database_arguments(parser)
    timeout = "the app's request timeout, as in its Policy (default: %(default)g)"
    parser.add_argument(
        "--request-timeout", type=float, default=30.0, metavar="SECONDS", help=timeout
    )
    stale = "the app's stale threshold if it sets one (default: derived from the timeout)"
    parser.add_argument("--stale-after", type=float, metavar="SECONDS", help=stale)
    add_json_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    policy = Policy(request_timeout=args.request_timeout, stale_after=args.stale_after)
    with operated_store(args) as store:
        stats = store.stats().snapshot(time.time(), args.request_timeout, policy.stale_seconds)
    if args.json:
        print_json(stats_json(stats))
        return 0
    _print_counts(stats)
    print_pairs(f"{stats.table}: what needs attention", _attention(stats))
    return 0


def stats_json(stats: StoreStats) -> dict[str, Any]:
    oldest = stats.oldest_in_progress
    return {
        "table": stats.table,
        "now": iso(stats.now),
        "total": stats.total,
        "by_state": stats.by_state(),
        "by_state_and_endpoint": [
            {"state": state, "endpoint": endpoint, "count": n}
            for state, endpoint, n in stats.counts
        ],
        "oldest_in_progress": None
        if oldest is None
        else {
            "principal": oldest.principal,
            "key": oldest.key,
            "key_digest": key_digest(oldest.principal, oldest.key),
            "endpoint": oldest.endpoint,
            "created_at": iso(oldest.created_at),
            "updated_at": iso(oldest.updated_at),
            "idle_seconds": round(stats.now - oldest.updated_at, 3),
        },
        "request_timeout_seconds": stats.request_timeout,
        "stale_after_seconds": stats.stale_after,
        "in_progress_past_request_timeout": stats.past_request_timeout,
        "in_progress_past_stale_threshold": stats.past_stale_threshold,
        "expired_unpurged": stats.expired_unpurged,
    }


def _print_counts(stats: StoreStats) -> None:
    per_endpoint: dict[str, dict[str, int]] = {}
    for state, endpoint, n in stats.counts:
        per_endpoint.setdefault(endpoint, dict.fromkeys(_STATES, 0))[state] = n
    rows: list[list[Any]] = [
        [endpoint or "(none)", *(counts[s] for s in _STATES), sum(counts.values())]
        for endpoint, counts in sorted(per_endpoint.items())
    ]
    totals = stats.by_state()
    rows.append(["all endpoints", *(totals[s] for s in _STATES), stats.total])
    headers = ["endpoint", *_STATES, "total"]
    print_table(f"{stats.table}: records by state", headers, rows, numeric=len(_STATES) + 1)


def _attention(stats: StoreStats) -> list[tuple[str, Any]]:
    oldest = stats.oldest_in_progress
    rows: list[tuple[str, Any]] = [("oldest in_progress", "none")]
    if oldest is not None:
        endpoint = oldest.endpoint or "no endpoint"
        who = f"principal {oldest.principal!r}, key {oldest.key!r} ({endpoint})"
        idle = f"{age(stats.now - oldest.updated_at)} (since {iso(oldest.updated_at)})"
        rows = [("oldest in_progress", who), ("  idle for", idle)]
    timeout = f"in_progress older than the request timeout ({stats.request_timeout:g}s)"
    stale = f"in_progress past the stale threshold ({stats.stale_after:g}s)"
    return [
        *rows,
        (timeout, stats.past_request_timeout),
        (stale, stats.past_stale_threshold),
        ("expired, not purged yet", stats.expired_unpurged),
    ]
