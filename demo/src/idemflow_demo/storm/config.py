"""What a storm does: its settings, and the keys it sends (one plan per key)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from urllib.parse import urlsplit

from idemflow import ConfigurationError, Policy

from ..settings import SHUTDOWN_MARGIN

__all__ = ["DEFAULT_TOKENS", "KeyPlan", "StormConfig", "plan_keys"]

#: principal → bearer token: the demo's two default principals.
DEFAULT_TOKENS: Mapping[str, str] = MappingProxyType({"alice": "alice-token", "bob": "bob-token"})
CURRENCIES = ("EUR", "USD", "GBP", "CHF")
#: Customers named ``declined…`` are declined by the demo's provider (402, stored).
DECLINED_PREFIX = "declined-"
#: The demo's ``--claim-commit`` modes.
CLAIM_COMMITS = ("own", "single")


@dataclass(frozen=True, slots=True)
class StormConfig:
    """One storm. Durations are seconds.

    Args:
        url: the service to attack; None starts the demo (and may kill it).
        database: the demo's database URL (None: SQLite in ``data_dir``).
        more_databases: more URLs, one more demo on each, all sharing the first
            one's data folder (so one provider ledger): the nodes of a
            multi-primary cluster (Galera), or several app servers on one
            database. Each key's clients go to different demos, so its
            claimants race through different nodes.
        keys: distinct idempotency keys, each a payment of its own.
        retries: concurrent clients per key, each retrying until it gets an answer.
        duration: the attack window: keys start at random moments within it,
            and kills happen only within it.
        kill_every: SIGKILL the demo about this often (None: never).
        min_kills: go on killing past the window until this many kills are done
            (as long as clients are still at work).
        request_timeout: the service's request timeout; the stale threshold
            (``2 × timeout + 10 s``) and so the time given to settle derive from it.
        sweep_every: how often the demo's sweeper runs (None: half the timeout).
        provider_latency_ms: each provider call's latency (the demo only).
        provider_failure_rate: share of provider calls failing transiently (the demo only).
        declined_share: share of keys whose customer the provider declines (402).
        seed: makes the keys, bodies, start times and kill moments reproducible.
        settle_for: how long clients keep retrying after the attack window
            (None: the stale threshold + two sweeps + 10 s).
        max_backoff: the cap of a client's backoff between attempts where the
            server gives no ``Retry-After`` (a refused connection while the demo restarts).
        data_dir: where the demo keeps its files (None: a fresh temporary folder).
        port: the port the demo listens on, ``port + n`` for demo n of several
            (None: a free one).
        tokens: principal → bearer token.
        claim_commit: how the demo commits each claim: ``own`` (a commit of its
            own) or ``single`` (with the payment's first phase; PostgreSQL only).
        partition_every: cut the network between the demo and its database
            about this often (None: never); needs a PostgreSQL, MySQL/MariaDB or
            Redis ``database``. See
            :mod:`idemflow_demo.storm.network`.
        partition_for: how long a partition lasts, on average.
        network_delay_ms, network_jitter_ms: every chunk on that link waits
            ``delay ± jitter``.
        network_stall_rate: the share of chunks "lost" (one retransmission
            timeout late).
    """

    url: str | None = None
    database: str | None = None
    more_databases: tuple[str, ...] = ()
    keys: int = 150
    retries: int = 3
    duration: float = 20.0
    kill_every: float | None = 2.5
    min_kills: int = 0
    request_timeout: float = 2.0
    sweep_every: float | None = None
    provider_latency_ms: int = 100
    provider_failure_rate: float = 0.1
    declined_share: float = 0.15
    seed: int | None = None
    settle_for: float | None = None
    max_backoff: float = 1.0
    data_dir: Path | None = None
    port: int | None = None
    tokens: Mapping[str, str] = field(default_factory=lambda: DEFAULT_TOKENS)
    claim_commit: str = "own"
    partition_every: float | None = None
    partition_for: float = 1.5
    network_delay_ms: float = 0.0
    network_jitter_ms: float = 0.0
    network_stall_rate: float = 0.0

    @property
    def network_faults(self) -> bool:
        """Whether the storm puts a faulty link between the demo and its database."""
        shaped = self.network_delay_ms or self.network_jitter_ms or self.network_stall_rate
        return self.partition_every is not None or bool(shaped)

    def __post_init__(self) -> None:
        checks = [
            (self.keys >= 1, "--keys must be at least 1"),
            (self.retries >= 1, "--retries must be at least 1"),
            (self.duration > 0, "--duration must be positive"),
            (self.kill_every is None or self.kill_every > 0, "--kill-every must be positive"),
            (self.min_kills >= 0, "--min-kills must not be negative"),
            (self.min_kills == 0 or self.kill_every is not None, "--min-kills needs kills"),
            (self.request_timeout > 0, "--request-timeout must be positive"),
            (0 <= self.provider_failure_rate < 1, "--provider-failure-rate must be in [0, 1)"),
            (0 <= self.declined_share <= 1, "--declined-share must be in [0, 1]"),
            (self.provider_latency_ms >= 0, "--provider-latency-ms must not be negative"),
            (
                self.url is None or self.kill_every is None,
                "--kill-every needs the storm's own demo",
            ),
            (self.url is None or self.database is None, "--database is for the storm's own demo"),
            (
                not self.more_databases or self.database is not None,
                "more than one --database needs a first one",
            ),
            (self.url is None or self.data_dir is None, "--data-dir is for the storm's own demo"),
            (bool(self.tokens), "at least one principal is needed"),
            (self.claim_commit in CLAIM_COMMITS, "--claim-commit must be own or single"),
            (
                self.url is None or self.claim_commit == "own",
                "--claim-commit is for the storm's own demo",
            ),
            (
                self.claim_commit == "own" or _is_postgres(self.database),
                "--claim-commit single needs --database postgresql://…: SQLite commits "
                "each claim on its own (one writer: an uncommitted claim would hold "
                "every other claim behind it)",
            ),
        ]
        checks += [
            (
                self.partition_every is None or self.partition_every > 0,
                "--partition-every must be positive",
            ),
            (self.partition_for > 0, "--partition-for must be positive"),
            (
                min(self.network_delay_ms, self.network_jitter_ms) >= 0,
                "--network-delay-ms and --network-jitter-ms must not be negative",
            ),
            (0 <= self.network_stall_rate < 1, "--network-stall-rate must be in [0, 1)"),
            (
                not self.network_faults
                or (self.url is None and all(is_networked(db) for db in self.databases)),
                "network faults need the storm's own demo on --database postgresql://…, "
                "mysql://… or redis://…: the faulty link sits between the demo and its database",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigurationError(message)

    @property
    def databases(self) -> tuple[str, ...]:
        """Every database a demo of the storm's runs on (none: SQLite)."""
        return (self.database, *self.more_databases) if self.database else ()

    @property
    def shutdown_grace(self) -> float:
        """How long the demo's graceful shutdown may wait for requests in flight."""
        return self.request_timeout + SHUTDOWN_MARGIN.total_seconds()

    @property
    def stale_after(self) -> float:
        """The service's stale threshold: its Policy's, derived from the request timeout."""
        return Policy(request_timeout=self.request_timeout).stale_seconds

    @property
    def sweep_interval(self) -> float:
        return self.sweep_every if self.sweep_every is not None else self.request_timeout / 2

    @property
    def settle_seconds(self) -> float:
        """How long after the attack window a key may take to get its answer.

        A claim orphaned by the last kill blocks its key (409) until it is
        older than the stale threshold and a sweep has resolved it.
        """
        if self.settle_for is not None:
            return self.settle_for
        return self.stale_after + 2 * self.sweep_interval + 10


@dataclass(frozen=True, slots=True)
class KeyPlan:
    """One key: who sends it, what body (unique to the key), and when its clients start."""

    index: int
    key: str
    principal: str
    body: bytes
    customer: str
    start: float

    @property
    def declined(self) -> bool:
        return self.customer.startswith(DECLINED_PREFIX)


def plan_keys(config: StormConfig, run_id: str, rng: random.Random) -> list[KeyPlan]:
    """The storm's keys; the customer names the run and the key, so the ledger maps back."""
    principals = sorted(config.tokens)
    plans = []
    for index in range(config.keys):
        declined = rng.random() < config.declined_share
        customer = f"{DECLINED_PREFIX if declined else ''}storm-{run_id}-{index:05d}"
        content = {
            "amount": rng.randint(100, 99_999),
            "currency": rng.choice(CURRENCIES),
            "customer": customer,
        }
        plans.append(
            KeyPlan(
                index=index,
                key=f"storm-{run_id}-{index:05d}",
                principal=rng.choice(principals),
                body=json.dumps(content).encode(),
                customer=customer,
                start=rng.uniform(0, config.duration),
            )
        )
    return plans


def _scheme(database: str | None) -> str:
    return urlsplit(database or "").scheme.lower().split("+", 1)[0]


def _is_postgres(database: str | None) -> bool:
    return _scheme(database) in ("postgresql", "postgres")


#: Databases the demo reaches over TCP, so through the storm's faulty link;
#: the port each listens on by default.
NETWORKED = MappingProxyType(
    {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mariadb": 3306, "redis": 6379}
)


def is_networked(database: str | None) -> bool:
    """Does the demo reach ``database`` over TCP (not an embedded SQLite file)?"""
    return _scheme(database) in NETWORKED


def default_port(database: str) -> int:
    """The port ``database`` names, or its scheme's default."""
    return urlsplit(database).port or NETWORKED.get(_scheme(database), 5432)


def key_index(customer: str, run_id: str) -> int | None:
    """The key index a ledger customer belongs to, or None if not this run's."""
    name = customer.removeprefix(DECLINED_PREFIX)
    prefix = f"storm-{run_id}-"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])
