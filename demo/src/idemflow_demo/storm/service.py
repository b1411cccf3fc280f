"""
What the service says after the storm: its payments, the provider's ledger, its metrics.

Only HTTP, so ``--url`` works against any deployment of the demo. A kill
resets the victim's in-memory counters, so ``/metrics`` is scraped right
before every kill and the incarnations' last readings are added up.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from .config import StormConfig, key_index

__all__ = ["Ledger", "MetricsTally", "parse_metrics", "read_ledger"]

#: The counters the verdict shows: ``requests:<outcome>``, ``stale_reclaimed:<resolution>``.
REQUESTS = "idemflow_requests_total"
STALE_RECLAIMED = "idemflow_stale_reclaimed_total"


@dataclass(frozen=True, slots=True)
class Ledger:
    """This run's rows: payments (by principal) and provider charges."""

    payments: list[dict[str, Any]]
    charges: list[dict[str, Any]]
    #: Lists that came back full: rows may be missing, nothing can be concluded.
    truncated: list[str] = field(default_factory=list)


async def read_ledger(
    http: httpx.AsyncClient, config: StormConfig, run_id: str, limit: int
) -> Ledger:
    """GET /payments for every principal and GET /provider/charges; keep this run's rows."""
    payments: list[dict[str, Any]] = []
    truncated = []
    for principal, token in sorted(config.tokens.items()):
        rows = await _list(http, "/payments", "payments", limit, token)
        truncated += [f"GET /payments ({principal})"] if len(rows) >= limit else []
        payments += [{**row, "principal": principal} for row in rows]
    charges = await _list(http, "/provider/charges", "charges", limit, None)
    truncated += ["GET /provider/charges"] if len(charges) >= limit else []
    return Ledger(
        [p for p in payments if key_index(str(p["customer"]), run_id) is not None],
        [c for c in charges if key_index(str(c["customer"]), run_id) is not None],
        truncated,
    )


async def _list(
    http: httpx.AsyncClient, path: str, member: str, limit: int, token: str | None
) -> list[dict[str, Any]]:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    response = await http.get(path, params={"limit": limit}, headers=headers)
    response.raise_for_status()
    rows: list[dict[str, Any]] = response.json()[member]
    return rows


def parse_metrics(text: str) -> dict[str, float]:
    """The counters the verdict needs from Prometheus text, summed over other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: defaultdict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REQUESTS:
                totals[f"requests:{sample.labels.get('outcome')}"] += sample.value
            elif sample.name == STALE_RECLAIMED:
                totals[f"stale_reclaimed:{sample.labels.get('resolution')}"] += sample.value
    return dict(totals)


class MetricsTally:
    """Counters added up over the victim's incarnations (each starts from zero)."""

    def __init__(self) -> None:
        self._last: dict[int, dict[str, float]] = {}
        self._baseline: dict[str, float] = {}
        self._failed: set[int] = set()

    async def scrape(
        self, http: httpx.AsyncClient, incarnation: int, *, timeout: float = 10.0
    ) -> None:
        """Read ``/metrics`` now; an incarnation never read is counted in :attr:`missed`."""
        try:
            response = await http.get("/metrics", timeout=timeout)
            response.raise_for_status()
        except httpx.HTTPError:
            self._failed.add(incarnation)
            return
        self.record(incarnation, parse_metrics(response.text))

    @property
    def missed(self) -> int:
        """Incarnations whose counters were never read: the totals are then a lower bound."""
        return len(self._failed - set(self._last))

    def record(self, incarnation: int, reading: dict[str, float]) -> None:
        """An incarnation's latest reading (its counters only grow until it dies)."""
        self._last[incarnation] = reading

    def set_baseline(self, incarnation: int) -> None:
        """What a service we did not start had counted before the storm."""
        self._baseline = dict(self._last.get(incarnation, {}))

    def totals(self) -> Mapping[str, float]:
        total: defaultdict[str, float] = defaultdict(float)
        for reading in self._last.values():
            for name, value in reading.items():
                total[name] += value
        for name, value in self._baseline.items():
            total[name] -= value
        return dict(total)
