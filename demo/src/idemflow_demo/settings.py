"""The demo's settings: one frozen value built from the command line (or by tests)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType

from idemflow import ConfigurationError

__all__ = ["DEFAULT_TOKENS", "SHUTDOWN_MARGIN", "Settings", "parse_duration", "parse_token"]

#: token → principal. Printed at start; more with ``--token NAME:TOKEN``.
DEFAULT_TOKENS: Mapping[str, str] = MappingProxyType({"alice-token": "alice", "bob-token": "bob"})

#: Beyond the request timeout, what a graceful shutdown allows for the last writes.
SHUTDOWN_MARGIN = timedelta(seconds=5)

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(text: str) -> timedelta:
    """``24h``, ``30m``, ``90s``, ``250ms``, ``2d``; a bare number is seconds."""
    match = _DURATION.match(text)
    if match is None:
        msg = f"not a duration: {text!r} (write e.g. 24h, 30m, 90s)"
        raise ConfigurationError(msg)
    number, unit = match.groups()
    value = timedelta(seconds=float(number) * _UNITS[unit or "s"])
    if value <= timedelta(0):
        msg = f"duration must be positive: {text!r}"
        raise ConfigurationError(msg)
    return value


def parse_token(text: str) -> tuple[str, str]:
    """``NAME:TOKEN`` → ``(token, name)``."""
    name, sep, token = text.partition(":")
    if not sep or not name.strip() or not token.strip():
        msg = f"--token takes NAME:TOKEN, got {text!r}"
        raise ConfigurationError(msg)
    return token.strip(), name.strip()


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the demo service needs to start.

    ``database_url`` None means embedded SQLite under ``data_dir``; a
    ``redis://`` URL keeps the keys in Redis and the payments in that SQLite
    file. The fake provider's ledger always lives in its own SQLite file under
    ``data_dir``: charging it and writing the payment row are a real dual write.
    """

    database_url: str | None = None
    data_dir: Path = Path("idemflow-data")
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout: timedelta = timedelta(seconds=30)
    retention: timedelta = timedelta(hours=24)
    provider_latency_ms: int = 0
    provider_failure_rate: float = 0.0
    tokens: Mapping[str, str] = field(default_factory=lambda: DEFAULT_TOKENS)
    access_log: bool = True
    #: Benchmark only: also serve ``POST /_bench/payments``, the same business
    #: write with idempotency switched off.
    bench_routes: bool = False
    #: Seed for the provider's injected failures (None: unpredictable).
    provider_seed: int | None = None
    pool_size: int = 8
    #: PostgreSQL: how the claim commits (``own`` or ``single``; see
    #: ``idemflow_demo.db.CLAIM_COMMITS``). The others always commit it alone.
    claim_commit: str = "own"
    #: Resolve crashed claims in the background (``idemflow_demo.recovery``).
    sweeper: bool = True
    #: How often the sweeper runs; None: every request timeout.
    sweep_every: timedelta | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.provider_failure_rate <= 1.0:
            raise ConfigurationError("--provider-failure-rate must be between 0 and 1")
        if self.provider_latency_ms < 0:
            raise ConfigurationError("--provider-latency-ms must not be negative")
        if not 0 <= self.port <= 65535:
            raise ConfigurationError("--port must be between 0 and 65535")
        if not self.tokens:
            raise ConfigurationError("at least one --token is needed")
        if self.pool_size < 1:
            raise ConfigurationError("--pool-size must be at least 1")

    @property
    def shutdown_grace(self) -> timedelta:
        """How long a graceful shutdown (SIGTERM) waits for requests in flight.

        At least the request timeout, plus room for the writes after it (the
        completion or the release), so a shutdown never cuts a request off
        mid-way and orphans its claim until the sweeper comes.
        """
        return self.request_timeout + SHUTDOWN_MARGIN

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "payments.db"

    @property
    def provider_path(self) -> Path:
        return self.data_dir / "provider.db"
