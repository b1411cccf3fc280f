"""``idemflow consumer-storm``: storm a Redis Streams consumer group, killing consumers and
the broker; print a verdict.

The command's arguments, registered by the library's thin loader
(``idemflow.cli``). Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register"]

#: The verdict found a broken guarantee (as for ``idemflow storm``).
EXIT_VIOLATED = 3


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "consumer-storm",
        help="storm a Redis Streams consumer while SIGKILLing it and its broker; verify "
        "exactly-once",
        description=(
            "Start a private redis-server (appendonly, a free loopback port), publish every "
            "message to a stream one to --copies times, consume it with --consumers "
            "processes on idemflow's AsyncRedisStreams (each effect a row written in the "
            "transaction its completion commits in), SIGKILL consumers at random and restart "
            "them, SIGKILL and restart the broker, run the sweeper, then count the effects. "
            f"Exit 0 when exactly once held, {EXIT_VIOLATED} when it broke, 1 when the storm "
            "could not run."
        ),
    )
    add = parser.add_argument
    add("--keys", type=int, default=200, metavar="N", help="messages (default: %(default)s)")
    add(
        "--copies",
        type=int,
        default=3,
        metavar="N",
        help="each message is published 1 to N times (default: %(default)s)",
    )
    add("--consumers", type=int, default=3, metavar="N", help="processes (default: %(default)s)")
    add(
        "--duration",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the window: messages are published, and kills happen, within it "
        "(default: %(default)g)",
    )
    add(
        "--kill-every",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="SIGKILL a consumer about this often, 0 for never (default: %(default)g)",
    )
    add(
        "--broker-restarts",
        type=int,
        default=1,
        metavar="N",
        help="SIGKILL and restart the broker N times within the window (default: %(default)s)",
    )
    add(
        "--database",
        metavar="URL",
        help="postgresql://… for the key records and effect rows (default: SQLite under the "
        "data folder)",
    )
    add(
        "--request-timeout",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="the consumers' claimed duration, renewed while a handler runs; the stale "
        "threshold derives from it (default: %(default)g)",
    )
    add(
        "--settle-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to wait after the window for every message to settle (default: the "
        "stale threshold + 10 s)",
    )
    add("--seed", type=int, default=None, metavar="N", help="make the plan reproducible")
    add(
        "--data-dir",
        type=Path,
        default=None,
        metavar="PATH",
        help="keep the broker's, the consumers' and SQLite's files here (default: a temporary "
        "folder, removed when green)",
    )
    add("--json", action="store_true", help="print the verdict as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from idemflow import ConfigurationError

    try:
        from .run import ConsumerStormConfig, run_consumer_storm
    except ImportError as exc:  # redis-py comes with the demo's redis extra
        msg = f"the consumer storm needs redis-py: pip install './demo[redis]' ({exc})"
        raise ConfigurationError(msg) from exc
    if args.database and not args.database.startswith(("postgresql:", "postgres:")):
        raise ConfigurationError("--database: a postgresql:// URL (default: SQLite)")
    config = ConsumerStormConfig(
        keys=args.keys,
        copies=args.copies,
        consumers=args.consumers,
        duration=args.duration,
        kill_every=args.kill_every,
        broker_restarts=args.broker_restarts,
        database=args.database,
        request_timeout=args.request_timeout,
        settle_for=args.settle_for,
        seed=args.seed,
        data_dir=args.data_dir,
    )
    verdict = run_consumer_storm(config)
    if args.json:
        print(verdict.to_json())
    else:
        facts = verdict.facts
        print(f"idemflow consumer-storm: Redis Streams at {facts['broker']} (appendonly),")
        print(f"  effects and key records in {facts['effects']} (run {facts['run']})")
        print("\n".join(verdict.lines()))
        if "files" in facts:
            print(
                f"  the broker's, the consumers' and the database's files are in {facts['files']}"
            )
    return 0 if verdict.ok else EXIT_VIOLATED
