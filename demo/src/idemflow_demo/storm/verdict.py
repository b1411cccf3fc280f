"""
The verdict: what the clients saw, set against what the service and the provider hold.

Pure: no I/O, so every way a storm can fail is tested on made-up inputs
(``tests/guarantees/test_storm.py``). A key is *exactly once* when it has one payment
row, one provider charge, and every client got the same settled answer, the
one that names that payment and that charge.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .clients import KeyTally
from .config import key_index
from .service import Ledger

__all__ = ["Verdict", "judge"]

#: Statuses a payment may answer below 500: charged, declined, in progress. Any
#: other 4xx is a wrong answer (a 422 would mean the fingerprint changed).
EXPECTED = frozenset({201, 402, 409})


@dataclass(frozen=True, slots=True)
class Verdict:
    """The storm's figures; :attr:`violations` names every guarantee that broke."""

    keys: int
    clients_per_key: int
    requests: int
    responses: dict[str, int]
    connection_errors: int
    replays: int
    conflicts: int
    releases: float
    stale_reclaimed: dict[str, float]
    lease_lost: float
    payments: int
    charges: int
    kills: int
    duplicate_charges: int
    duplicate_payments: int
    different_answers: int
    unresolved: int
    inconsistent: int
    wrong_answers: int
    #: 5xx other than 503: the server failed (the claim was released; clients
    #: retry them as HTTP says). Shown, not a violation of exactly-once.
    server_errors: int = 0
    #: 409 and 503 answers without ``Retry-After``: a client cannot know when to retry.
    without_retry_after: int = 0
    truncated: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    #: Killed incarnations whose /metrics could not be read: counters are a lower bound.
    metrics_missed: int = 0
    details: dict[str, list[str]] = field(default_factory=dict)

    @property
    def violations(self) -> list[str]:
        checks = {
            "duplicate charges": self.duplicate_charges,
            "duplicate payments": self.duplicate_payments,
            "keys with two different answers": self.different_answers,
            "keys never resolved": self.unresolved,
            "answers disagreeing with the ledger": self.inconsistent,
            "wrong answers": self.wrong_answers,
            "409 or 503 without Retry-After": self.without_retry_after,
            "lists cut short (cannot verify)": len(self.truncated),
        }
        return [name for name, count in checks.items() if count]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "violations": self.violations, "ok": self.ok}


def judge(
    tallies: Sequence[KeyTally],
    ledger: Ledger,
    metrics: Mapping[str, float],
    *,
    run_id: str,
    clients_per_key: int,
    kills: int,
    elapsed: float,
    metrics_missed: int = 0,
) -> Verdict:
    """Compare every key's answers with its rows in the service and the ledger."""
    payments = _by_key(ledger.payments, run_id)
    charges = _by_key(ledger.charges, run_id)
    statuses: Counter[int] = Counter()
    for tally in tallies:
        statuses.update(tally.statuses)
    details = {
        "duplicate charges": _duplicates(charges, ledger.charges),
        "duplicate payments": [t.plan.key for t in tallies if len(payments[t.plan.index]) > 1],
        "different answers": [t.plan.key for t in tallies if len(t.answers) > 1],
        "unresolved": [t.plan.key for t in tallies if not t.resolved],
        "wrong answers": [
            f"{status} × {n}" for status, n in sorted(statuses.items()) if _unexpected(status)
        ],
        "without retry-after": [t.plan.key for t in tallies if t.without_retry_after],
        "server errors": [
            f"{status} × {n}" for status, n in sorted(statuses.items()) if _server_error(status)
        ],
        "inconsistent": [
            t.plan.key
            for t in tallies
            if len(t.answers) == 1
            and (
                t.late_replayed is False
                or not _consistent(t, payments[t.plan.index], charges[t.plan.index])
            )
        ],
    }
    return Verdict(
        keys=len(tallies),
        clients_per_key=clients_per_key,
        requests=sum(t.requests for t in tallies),
        responses={str(status): n for status, n in sorted(statuses.items())},
        connection_errors=sum(t.errors for t in tallies),
        replays=sum(t.replays for t in tallies),
        conflicts=statuses[409],
        releases=metrics.get("requests:released", 0.0),
        stale_reclaimed={
            resolution: metrics.get(f"stale_reclaimed:{resolution}", 0.0)
            for resolution in ("completed", "released", "unknown")
        },
        lease_lost=metrics.get("requests:lease_lost", 0.0),
        payments=len(ledger.payments),
        charges=len(ledger.charges),
        kills=kills,
        duplicate_charges=len(details["duplicate charges"]),
        duplicate_payments=len(details["duplicate payments"]),
        different_answers=len(details["different answers"]),
        unresolved=len(details["unresolved"]),
        inconsistent=len(details["inconsistent"]),
        wrong_answers=sum(n for s, n in statuses.items() if _unexpected(s)),
        server_errors=sum(n for s, n in statuses.items() if _server_error(s)),
        without_retry_after=sum(t.without_retry_after for t in tallies),
        truncated=list(ledger.truncated),
        elapsed=round(elapsed, 1),
        metrics_missed=metrics_missed,
        details={name: keys for name, keys in details.items() if keys},
    )


def _unexpected(status: int) -> bool:
    return status < 500 and status not in EXPECTED


def _server_error(status: int) -> bool:
    return status >= 500 and status != 503


def _by_key(rows: Iterable[Mapping[str, Any]], run_id: str) -> dict[int, list[Mapping[str, Any]]]:
    """Rows by key index; every key index, with or without rows, maps to a list."""
    grouped: defaultdict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        index = key_index(str(row["customer"]), run_id)
        if index is not None:
            grouped[index].append(row)
    return grouped


def _duplicates(
    charges: Mapping[int, list[Mapping[str, Any]]], ledger: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Keys charged more than once, and downstream keys charged more than once."""
    per_key = [
        f"{rows[0]['customer']} ({len(rows)} charges)" for rows in charges.values() if len(rows) > 1
    ]
    per_downstream = Counter(str(charge["downstream_key"]) for charge in ledger)
    return per_key + [f"{key} ({n} charges)" for key, n in per_downstream.items() if n > 1]


def _consistent(
    tally: KeyTally,
    payments: Sequence[Mapping[str, Any]],
    charges: Sequence[Mapping[str, Any]],
) -> bool:
    """The one answer names the key's one payment and one charge, in the same state."""
    if len(payments) != 1 or len(charges) != 1:
        return False
    (status, body), payment, charge = next(iter(tally.answers)), payments[0], charges[0]
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    expected = "succeeded" if status == 201 else "declined"
    named = answer.get("id") if status == 201 else answer.get("payment_id")
    return (
        payment["status"] == charge["status"] == expected
        and payment["charge_id"] == charge["id"] == answer.get("charge_id")
        and named == payment["id"]
        and payment["principal"] == tally.plan.principal
        and (status == 402) == tally.plan.declined
    )
