"""``idemflow demo``: run the demo payments service (uvicorn, one worker).

The command's arguments, registered by the library's thin loader
(``idemflow.cli``). Nothing heavy is imported until the command runs,
so ``idemflow --help`` and the other commands stay fast.
"""

from __future__ import annotations

import argparse
import math
import secrets
import socket
from datetime import timedelta
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from idemflow import ConfigurationError

from .settings import DEFAULT_TOKENS, Settings, parse_duration, parse_token

if TYPE_CHECKING:  # the app imports Starlette: only when the command runs
    from .app import DemoService

__all__ = ["banner", "register"]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="run the demo payments service",
        description=(
            "A small payments service protected by idemflow: POST /payments with an "
            "Idempotency-Key charges a fake external provider once, however often it is "
            "retried. Embedded SQLite under --data-dir by default; PostgreSQL, MySQL/MariaDB "
            "or Redis (keys in Redis, payments in SQLite) with --database."
        ),
    )
    add = parser.add_argument
    versions = f"idemflow-demo {version('idemflow-demo')} (idemflow {version('idemflow')})"
    add("--version", action="version", version=versions)
    add(
        "--database",
        metavar="URL",
        help="postgresql://…, mysql://… (or mariadb://…), or redis://… for the keys with the "
        "payments in SQLite under --data-dir; add ?allow_volatile=1 for a Redis without "
        "persistence, &key_prefix=NAME to share one (default: SQLite under --data-dir)",
    )
    add("--data-dir", default="idemflow-data", help="local data folder (default: %(default)s)")
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)")
    add(
        "--request-timeout",
        type=parse_duration,
        default=timedelta(seconds=30),
        metavar="SECONDS",
        help="longest a payment may take; 30, 30s, 2m (default: 30)",
    )
    add(
        "--retention",
        type=parse_duration,
        default=timedelta(hours=24),
        metavar="DURATION",
        help="how long a settled outcome is replayed, from when it settled: 24h, 30m, 2s "
        "(default: 24h)",
    )
    add(
        "--provider-latency-ms",
        type=int,
        default=0,
        metavar="N",
        help="latency of each provider call (default: 0)",
    )
    add(
        "--provider-failure-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="share of provider calls failing transiently, 0–1 (default: 0)",
    )
    add(
        "--sweep-every",
        # timedelta(0) stands for "off" (parse_duration refuses 0).
        type=lambda text: timedelta(0) if text == "off" else parse_duration(text),
        default=None,
        metavar="DURATION|off",
        help="resolve crashed claims and abandoned intents this often, asking the provider "
        "(default: a tenth of the stale threshold, at most the request timeout); off: never",
    )
    add(
        "--token",
        action="append",
        type=parse_token,
        default=[],
        metavar="NAME:TOKEN",
        help="another principal and its bearer token (repeatable)",
    )
    add(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log every request (default: on)",
    )
    # For the benchmark and the tests only.
    add("--bench-routes", action="store_true", help=argparse.SUPPRESS)
    add("--provider-seed", type=int, default=None, help=argparse.SUPPRESS)
    add(
        "--pool-size",
        type=int,
        default=8,
        metavar="N",
        help="pooled connections, shared by the key store and the endpoints on PostgreSQL "
        "(on MySQL as many again for the key store; on SQLite and Redis the endpoints' "
        "only) (default: %(default)s)",
    )
    add(
        "--claim-commit",
        choices=("own", "single"),
        default="own",
        help="PostgreSQL: commit the claim on its own (own), or with the payment's first "
        "phase (single: one commit fewer); the other databases run own only "
        "(default: %(default)s)",
    )
    parser.set_defaults(run=run)


def settings_from(args: argparse.Namespace) -> Settings:
    from pathlib import Path

    return Settings(
        database_url=args.database,
        data_dir=Path(args.data_dir),
        host=args.host,
        port=args.port,
        request_timeout=args.request_timeout,
        retention=args.retention,
        provider_latency_ms=args.provider_latency_ms,
        provider_failure_rate=args.provider_failure_rate,
        tokens={**DEFAULT_TOKENS, **dict(args.token)},
        access_log=args.access_log,
        bench_routes=args.bench_routes,
        provider_seed=args.provider_seed,
        claim_commit=args.claim_commit,
        pool_size=args.pool_size,
        sweeper=args.sweep_every != timedelta(0),
        sweep_every=args.sweep_every or None,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    settings = settings_from(args)
    sock = _bind(settings.host, settings.port)
    try:
        asyncio.run(_serve(settings, sock))
    finally:
        sock.close()  # uvicorn closes it too; not when the service never started
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """Bind and listen before the app starts, so ``--port 0`` can print the port it got."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say
    # so, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made right after the banner wait here
    return sock


async def _serve(settings: Settings, sock: socket.socket) -> None:
    """Start the service (database first, so a bad URL is one clear line), then uvicorn."""
    import logging

    import uvicorn

    from .app import DemoService, create_app

    service = DemoService(settings)
    try:
        await service.start()
    except Exception as exc:
        await service.stop()
        where = settings.database_url or str(settings.sqlite_path)
        msg = f"cannot open the database {where.split('@')[-1]}: {type(exc).__name__}: {exc}"
        raise ConfigurationError(msg) from exc
    config = uvicorn.Config(
        create_app(service),
        workers=1,
        lifespan="on",
        access_log=settings.access_log,
        log_level="info",
        # SIGTERM waits for requests in flight at least the request timeout:
        # cut off earlier, a request would leave its claim for the sweeper.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace.total_seconds()),
    )
    # Only warnings from the server itself; the banner says where it listens.
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    print(banner(settings, sock.getsockname()[1]), flush=True)
    try:
        await _server(uvicorn, config, service).serve(sockets=[sock])
    finally:
        await service.stop()


def _server(uvicorn: Any, config: Any, service: DemoService) -> Any:
    """A uvicorn server that stops the service once requests in flight are done.

    On SIGTERM uvicorn re-raises the signal as soon as it has shut down, so
    code after ``serve()`` never runs: the sweeper and the pool stop here.
    """

    class Server(uvicorn.Server):  # type: ignore[misc]
        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets=sockets)
            await service.stop()

    return Server(config)


def banner(settings: Settings, port: int) -> str:
    """Where it listens, the tokens, and three curl lines: a charge, a replay, a 422."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "") else settings.host
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    where = f"keys + payments: {settings.database_url or f'SQLite {settings.sqlite_path}'}"
    if settings.database_url and settings.database_url.lower().startswith("redis"):
        where = f"keys: {settings.database_url}; payments: SQLite {settings.sqlite_path}"
    tokens = ", ".join(f"{name}: {token}" for token, name in settings.tokens.items())
    key = f"demo-{secrets.token_hex(4)}"
    token = next(iter(settings.tokens))
    post = (
        f"curl -i -X POST {url}/payments -H 'Authorization: Bearer {token}' "
        f"-H 'Idempotency-Key: {key}' -H 'Content-Type: application/json' -d "
    )
    first = """'{"amount": 1000, "currency": "EUR", "customer": "ada"}'"""
    other = """'{"amount": 2500, "currency": "EUR", "customer": "ada"}'"""
    return "\n".join(
        [
            f"idemflow demo: payments service listening on {url}",
            f"  {where}; provider ledger: SQLite {settings.provider_path}",
            f"  bearer tokens: {tokens}",
            "",
            "Try it (paste into another terminal):",
            "  # 1. a first charge: 201 Created with Location",
            f"  {post}{first}",
            "  # 2. the same request again: the stored 201, Idempotent-Replayed: true, no charge",
            f"  {post}{first}",
            "  # 3. the same key with a different body: 422 problem",
            f"  {post}{other}",
            "",
            f"  See the provider's ledger: curl {url}/provider/charges   (Ctrl-C stops)",
        ]
    )
