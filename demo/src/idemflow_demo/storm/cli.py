"""``idemflow storm``: retry-storm a payments service, killing it now and then; print a verdict.

The command's arguments, registered by the library's thin loader
(``idemflow.cli``). Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["EXIT_VIOLATED", "register"]

#: The verdict found a broken guarantee (1 is "could not run", 2 a bad argument).
EXIT_VIOLATED = 3

# Defaults when the storm starts the demo itself (they mean nothing with --url).
DEMO_KILL_EVERY = 2.5
DEMO_LATENCY_MS = 100
DEMO_FAILURE_RATE = 0.1


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "storm",
        help="retry-storm the demo while SIGKILLing it; verify exactly-once",
        description=(
            "Start the demo payments service (SQLite in a fresh temporary folder, or "
            "--database), send many keys with several concurrent retrying clients each, "
            "SIGKILL the server at random moments and restart it on the same database, then "
            "check every answer against the payments and the provider's ledger. Exit 0 when "
            f"no guarantee broke, {EXIT_VIOLATED} when one did, 1 when the storm could not run."
        ),
    )
    add = parser.add_argument
    add("--url", help="attack this running service instead of starting the demo (no kills)")
    add(
        "--database",
        metavar="URL",
        action="append",
        help="the demo's database: postgresql://…, mysql://…, or redis://… (keys in Redis, "
        "payments in SQLite) (default: SQLite). Repeat it for one demo per URL (the nodes of "
        "a Galera cluster), sharing one provider ledger; each key's clients go to different "
        "demos",
    )
    add("--keys", type=int, default=150, metavar="N", help="distinct keys (default: %(default)s)")
    add(
        "--retries",
        type=int,
        default=3,
        metavar="N",
        help="concurrent retrying clients per key (default: %(default)s)",
    )
    add(
        "--duration",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="attack window: keys start, and kills happen, within it (default: %(default)g)",
    )
    add(
        "--kill-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"SIGKILL the demo about this often, 0 for never (default: {DEMO_KILL_EVERY:g})",
    )
    add(
        "--min-kills",
        type=int,
        default=0,
        metavar="N",
        help="go on killing past the window until N kills are done (default: %(default)s)",
    )
    add(
        "--request-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="the service's request timeout; the stale threshold derives from it "
        "(default: %(default)g, so crashed claims are swept within the run)",
    )
    add(
        "--provider-latency-ms",
        type=int,
        default=None,
        metavar="N",
        help=f"latency of each provider call (default: {DEMO_LATENCY_MS})",
    )
    add(
        "--provider-failure-rate",
        type=float,
        default=None,
        metavar="P",
        help=f"share of provider calls failing transiently (default: {DEMO_FAILURE_RATE:g})",
    )
    add(
        "--claim-commit",
        choices=("own", "single"),
        default="own",
        help="how the demo commits each claim: on its own, or with the payment's first phase "
        "(single: PostgreSQL only, refused on SQLite) (default: %(default)s)",
    )
    network = parser.add_argument_group(
        "network faults",
        "break the network between the demo and its PostgreSQL, MySQL/MariaDB or Redis "
        "(--database): a loopback relay the storm partitions, delays and stalls (this kernel "
        "has no netem)",
    )
    network.add_argument(
        "--partition-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="partition the link about this often (default: never)",
    )
    network.add_argument(
        "--partition-for",
        type=float,
        default=1.5,
        metavar="SECONDS",
        help="how long a partition lasts, on average (default: %(default)g)",
    )
    network.add_argument(
        "--network-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="delay of every chunk on the link (default: %(default)g)",
    )
    network.add_argument(
        "--network-jitter-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="± this much around the delay (default: %(default)g)",
    )
    network.add_argument(
        "--network-stall-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="share of chunks lost and retransmitted 200–600 ms late (default: %(default)g)",
    )
    add(
        "--declined-share",
        type=float,
        default=0.15,
        metavar="P",
        help="share of keys whose customer is declined: 402, stored (default: %(default)g)",
    )
    add(
        "--settle-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long clients keep retrying after the window (default: the stale "
        "threshold + two sweeps + 10 s)",
    )
    add(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="make keys, bodies and kill moments reproducible",
    )
    add(
        "--data-dir",
        type=Path,
        default=None,
        metavar="PATH",
        help="keep the demo's files here (default: a temporary folder, removed when green)",
    )
    add(
        "--port",
        type=int,
        default=None,
        metavar="N",
        help="the port the demo listens on, the next ones for more --database demos "
        "(default: a free one)",
    )
    add("--json", action="store_true", help="print the verdict as JSON")
    parser.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> Any:
    """The :class:`idemflow_demo.storm.StormConfig` the arguments describe."""
    from idemflow import ConfigurationError

    from . import StormConfig

    demo_only = ("kill_every", "provider_latency_ms", "provider_failure_rate", "data_dir", "port")
    if args.url:
        given = [name for name in demo_only if getattr(args, name) is not None]
        given += ["min_kills"] if args.min_kills else []
        given += ["claim_commit"] if args.claim_commit != "own" else []
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            msg = f"{flags}: only for the demo the storm starts itself, not with --url"
            raise ConfigurationError(msg)
    kill_every = DEMO_KILL_EVERY if args.kill_every is None else args.kill_every
    return StormConfig(
        url=args.url.rstrip("/") if args.url else None,
        database=args.database[0] if args.database else None,
        more_databases=tuple(args.database[1:]) if args.database else (),
        keys=args.keys,
        retries=args.retries,
        duration=args.duration,
        kill_every=None if args.url or kill_every == 0 else kill_every,
        min_kills=args.min_kills,
        request_timeout=args.request_timeout,
        provider_latency_ms=_or(args.provider_latency_ms, DEMO_LATENCY_MS),
        provider_failure_rate=_or(args.provider_failure_rate, DEMO_FAILURE_RATE),
        declined_share=args.declined_share,
        seed=args.seed,
        settle_for=args.settle_for,
        data_dir=args.data_dir,
        port=args.port,
        claim_commit=args.claim_commit,
        partition_every=args.partition_every,
        partition_for=args.partition_for,
        network_delay_ms=args.network_delay_ms,
        network_jitter_ms=args.network_jitter_ms,
        network_stall_rate=args.network_stall_rate,
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def run(args: argparse.Namespace) -> int:
    import asyncio

    from idemflow import ConfigurationError

    try:
        from . import run_storm
        from .report import render, render_json
    except ImportError as exc:  # httpx and the demo's server come with the demo's distribution
        msg = f"the storm needs the demo's dependencies: pip install ./demo ({exc})"
        raise ConfigurationError(msg) from exc

    config = config_from(args)
    result = asyncio.run(run_storm(config))
    verdict = result.verdict
    if args.json:
        extra = {
            "target": result.target,
            "run_id": result.run_id,
            "seed": result.seed,
            "claim_commit": config.claim_commit,
            "partitions": result.partitions,
            "connections_reset": result.resets,
        }
        render_json(verdict, {**extra, "data_dir": str(result.data_dir or "") or None})
    else:
        title = f"idemflow storm: {result.target} (run {result.run_id})"
        render(verdict, title)
        if result.partitions:
            print(f"  network: {result.partitions} partitions, {result.resets} connections reset")
        if result.data_dir is not None:
            print(f"  the demo's files and log are kept in {result.data_dir}")
    return 0 if verdict.ok else EXIT_VIOLATED
