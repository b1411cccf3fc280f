"""
The consumer storm's run: a private broker, producers that publish twice, consumers
killed and restarted, the broker killed and restarted, the sweeper, then the verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from idemflow import ConfigurationError, Policy, State
from idemflow.sweeper import Sweeper

from .worker import GROUP, effects_table

__all__ = ["ConsumerStormConfig", "ConsumerVerdict", "judge", "run_consumer_storm"]

#: How long a started (or restarted) redis-server has to answer PING.
BROKER_START = 10.0
#: How long the broker stays down when killed: producers and consumers meet it down.
BROKER_DOWN = 0.5


@dataclass(frozen=True)
class ConsumerStormConfig:
    """What to storm: ``keys`` messages, each published 1 to ``copies`` times within
    ``duration`` seconds, ``consumers`` processes, one SIGKILLed about every ``kill_every``
    seconds (0: never), the broker killed ``broker_restarts`` times, effects in SQLite
    under ``data_dir`` or in PostgreSQL at ``database``."""

    keys: int = 200
    copies: int = 3
    consumers: int = 3
    duration: float = 10.0
    kill_every: float = 1.0
    broker_restarts: int = 1
    database: str | None = None
    request_timeout: float = 0.5
    settle_for: float | None = None
    seed: int | None = None
    data_dir: Path | None = None


@dataclass
class ConsumerVerdict:
    """The storm's figures and its two guarantees: no effect twice, no message left."""

    messages: int
    duplicate_effects: int
    unresolved: int  # messages without their effect, claim completed and entries acked
    without_effect: int = 0
    claims_not_completed: int = 0
    entries_not_acked: int = 0
    dead_letters: int = 0
    effects: int = 0
    publishes: int = 0
    publish_retries: int = 0
    consumers: int = 0
    kills: int = 0
    broker_restarts: int = 0
    released_by_sweeper: int = 0
    settled_in: float | None = None
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.duplicate_effects == 0 and self.unresolved == 0

    def lines(self) -> list[str]:
        settled = "never" if self.settled_in is None else f"{self.settled_in:.1f} s after"
        rows = [
            ("messages", f"{self.messages}"),
            ("entries published", f"{self.publishes} ({self.publish_retries} publishes retried)"),
            ("consumer processes", f"{self.consumers}"),
            ("consumers SIGKILLed and restarted", f"{self.kills}"),
            ("broker SIGKILLed and restarted", f"{self.broker_restarts}"),
            ("claims released by the sweeper", f"{self.released_by_sweeper}"),
            ("effects written", f"{self.effects}"),
            ("settled", f"{settled} the window"),
        ]
        checks = [
            ("DUPLICATE EFFECTS", self.duplicate_effects),
            ("unresolved messages", self.unresolved),
        ]
        width = max(len(label) for label, _ in rows + checks) + 2
        out = [f"  {label:<{width}}{value}" for label, value in rows]
        out += [f"  {label:<{width}}{n}  {'ok' if n == 0 else 'VIOLATED'}" for label, n in checks]
        out.append(
            f"    (no effect {self.without_effect} · claim not completed "
            f"{self.claims_not_completed} · entries not acked {self.entries_not_acked} · "
            f"dead letters {self.dead_letters})"
        )
        word = "exactly once" if self.ok else "VIOLATED"
        out.append(
            f"verdict: {word}: {self.duplicate_effects} duplicate effects, "
            f"{self.unresolved} unresolved messages"
        )
        return out

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)


def judge(
    keys: list[str],
    effects: Counter[str],
    completed: set[str],
    left: Counter[str],
) -> ConsumerVerdict:
    """The guarantees from what the storm found: ``effects`` rows per message, the
    messages whose claim is ``completed``, the entries ``left`` per message (pending,
    never delivered, or dead-lettered)."""
    without = {key for key in keys if effects[key] == 0}
    not_completed = {key for key in keys if key not in completed}
    return ConsumerVerdict(
        messages=len(keys),
        duplicate_effects=sum(n - 1 for n in effects.values() if n > 1),
        unresolved=len(without | not_completed | set(left)),
        without_effect=len(without),
        claims_not_completed=len(not_completed),
        entries_not_acked=sum(left.values()),
        effects=sum(effects.values()),
    )


class Broker:
    """A private redis-server on a free loopback port, appending every write to its AOF
    under ``folder``: SIGKILLed and restarted, the stream and its group are still there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigurationError("the consumer storm needs redis-server on the PATH")
        options = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        options += ["--appendonly", "yes", "--save", "", "--logfile", "redis.log"]
        self.process = subprocess.Popen([binary, *options], stdin=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + BROKER_START
        while True:
            try:
                client.ping()
                break
            except (redis.BusyLoadingError, redis.ConnectionError):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    msg = f"redis-server did not start (see {self.folder / 'redis.log'})"
                    raise ConfigurationError(msg) from None
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Consumers:
    """The consumer processes, each restarted under its own name when killed."""

    def __init__(self, config: ConsumerStormConfig, argv: list[str], folder: Path) -> None:
        self.argv, self.folder = argv, folder
        self.processes = [self._start(f"consumer-{n}") for n in range(config.consumers)]

    def _start(self, name: str) -> tuple[str, subprocess.Popen[bytes]]:
        self._ready(name).unlink(missing_ok=True)
        log = (self.folder / f"{name}.log").open("ab")
        module = "idemflow_demo.consumer_storm.worker"
        url, stream, *rest = self.argv
        command = [sys.executable, "-m", module, url, stream, name, *rest, str(self._ready(name))]
        with log:
            return name, subprocess.Popen(command, stdout=log, stderr=log)

    def _ready(self, name: str) -> Path:
        return self.folder / f"{name}.ready"

    def kill_one(self, rng: random.Random) -> bool:
        """SIGKILL one consumer at work (not one still starting) and restart it."""
        at_work = [
            index
            for index, (name, process) in enumerate(self.processes)
            if self._ready(name).exists() and self._ready(name).read_text() == str(process.pid)
        ]
        if not at_work:
            return False
        index = rng.choice(at_work)
        name, process = self.processes[index]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        self.processes[index] = self._start(name)
        return True

    def stop(self) -> None:
        for _, process in self.processes:
            process.kill()
            process.wait()


@dataclass
class Producers:
    """Publish every message 1 to ``copies`` times at its moment in the window, each
    publish retried until the broker answers (a retry may publish one more copy)."""

    url: str
    stream: str
    plan: list[tuple[float, str]]  # (seconds into the window, message key), in order
    published: int = 0
    retries: int = 0

    def run(self, started: float) -> None:
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        for at, key in self.plan:
            time.sleep(max(0.0, started + at - time.monotonic()))
            payload = json.dumps({"message": key, "amount": 100}).encode()
            while True:
                try:
                    client.xadd(self.stream, {"idempotency-key": key, "payload": payload})
                    break
                except redis.RedisError:  # the broker restarting: the producer retries
                    self.retries += 1
                    time.sleep(0.1)
            self.published += 1
        client.close()


def run_consumer_storm(config: ConsumerStormConfig) -> ConsumerVerdict:
    """Storm, settle, judge; the files are removed when green unless ``data_dir`` was given."""
    rng = random.Random(config.seed)
    run_id = secrets.token_hex(3)
    folder = config.data_dir or Path(tempfile.mkdtemp(prefix="idemflow-consumer-storm-"))
    folder.mkdir(parents=True, exist_ok=True)
    policy = Policy(request_timeout=config.request_timeout)
    table, stream = f"idemflow_storm_{run_id}", f"orders-{run_id}"
    database = config.database or str(folder / "effects.db")
    store = _migrated(database, table, policy)
    broker = Broker(folder)
    try:
        broker.start()
        verdict = _storm(config, rng, broker, store, database, table, stream, policy, folder)
    finally:
        broker.kill()
        store.close()
    if verdict.ok and config.database:
        _drop(database, table)
    if verdict.ok and config.data_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        verdict.facts["files"] = str(folder)
    verdict.facts.update(run=run_id, broker=broker.url, effects=_where(database))
    return verdict


def _storm(
    config: ConsumerStormConfig,
    rng: random.Random,
    broker: Broker,
    store: Any,
    database: str,
    table: str,
    stream: str,
    policy: Policy,
    folder: Path,
) -> ConsumerVerdict:
    admin = redis.Redis.from_url(broker.url, decode_responses=True, socket_timeout=2)
    admin.xgroup_create(stream, GROUP, id="0", mkstream=True)
    keys = [f"message-{n:05d}" for n in range(config.keys)]
    plan = sorted(
        (at + rng.uniform(0, 0.3) * copy, key)
        for key in keys
        for at in [rng.uniform(0, config.duration)]
        for copy in range(rng.randint(1, config.copies))
    )
    producers = [Producers(broker.url, stream, plan[n::2]) for n in range(2)]
    argv = [broker.url, stream, database, table, str(config.request_timeout)]
    where = (admin, stream, store, database, table)
    consumers = Consumers(config, argv, folder)
    released = [0]
    try:
        with _sweeping(Sweeper(store, policy), released):
            started = time.monotonic()
            # Daemon threads: an interrupted storm does not wait for them to publish.
            threads = [
                threading.Thread(target=p.run, args=(started,), daemon=True) for p in producers
            ]
            for thread in threads:
                thread.start()
            kills, restarts = _chaos(config, rng, broker, consumers, started)
            for thread in threads:
                thread.join()
            settled_in = _settle(config, policy, lambda: _survey(*where, keys).unresolved)
    finally:
        consumers.stop()
    verdict = _survey(*where, keys)  # after the last kill
    admin.close()
    verdict.publishes = sum(p.published for p in producers)
    verdict.publish_retries = sum(p.retries for p in producers)
    verdict.consumers, verdict.kills, verdict.broker_restarts = config.consumers, kills, restarts
    verdict.released_by_sweeper, verdict.settled_in = released[0], settled_in
    return verdict


def _chaos(
    config: ConsumerStormConfig,
    rng: random.Random,
    broker: Broker,
    consumers: Consumers,
    started: float,
) -> tuple[int, int]:
    """Within the window: kill a consumer now and then, the broker at evenly spaced moments."""
    restarts_at = [
        config.duration * (n + 1) / (config.broker_restarts + 1)
        for n in range(config.broker_restarts)
    ]
    kills = restarts = 0
    next_kill = rng.uniform(0.5, 1.5) * config.kill_every if config.kill_every else None
    while (now := time.monotonic() - started) < config.duration:
        if restarts_at and now >= restarts_at[0]:
            restarts_at.pop(0)
            broker.kill()
            time.sleep(BROKER_DOWN)
            broker.start()
            restarts += 1
        if next_kill is not None and now >= next_kill:
            kills += consumers.kill_one(rng)
            next_kill = now + rng.uniform(0.5, 1.5) * config.kill_every
        time.sleep(0.02)
    return kills, restarts


def _settle(
    config: ConsumerStormConfig, policy: Policy, unresolved: Callable[[], int]
) -> float | None:
    """Seconds from the window's end until nothing is unresolved; None: not within
    ``settle_for`` (default: the stale threshold and 10 s)."""
    end = time.monotonic()
    settle = policy.stale_seconds + 10 if config.settle_for is None else config.settle_for
    while unresolved():
        if time.monotonic() - end > settle:
            return None
        time.sleep(0.25)
    return time.monotonic() - end


@contextlib.contextmanager
def _sweeping(sweeper: Sweeper, released: list[int]) -> Iterator[None]:
    """The sweeper's passes, twice a second, in a thread, counting the claims released."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):  # a pass that failed is retried next time
                released[0] += sweeper.sweep_once().released

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _survey(
    admin: Any, stream: str, store: Any, database: str, table: str, keys: list[str]
) -> ConsumerVerdict:
    """What the run left: effects per message, completed claims, entries not acked."""
    effects = Counter(dict(_query(database, _effects_sql(table))))
    completed = {
        key
        for key in keys
        if (record := store.get(stream, key)) is not None and record.state is State.COMPLETED
    }
    left: Counter[str] = Counter()
    try:
        (group,) = [g for g in admin.xinfo_groups(stream) if g["name"] == GROUP]
        pending = admin.xpending_range(stream, GROUP, "-", "+", 1_000_000)
        entries = [admin.xrange(stream, p["message_id"], p["message_id"]) for p in pending]
        entries.append(admin.xrange(stream, f"({group['last-delivered-id']}", "+"))
        dead = admin.xrange(f"{stream}:dead")
    except redis.RedisError:
        left["(the broker did not answer)"] += 1
        entries, dead = [], []
    for batch in [*entries, dead]:
        left.update(fields["idempotency-key"] for _, fields in batch)
    verdict = judge(keys, effects, completed, left)
    verdict.dead_letters = len(dead)
    return verdict


def _effects_sql(table: str) -> str:
    return f"SELECT message, count(*) FROM {effects_table(table)} GROUP BY message"


def _is_postgres(database: str) -> bool:
    return database.startswith(("postgresql:", "postgres:"))


def _query(database: str, sql: str) -> list[tuple[Any, ...]]:
    if _is_postgres(database):
        import psycopg

        with psycopg.connect(database, autocommit=True) as conn:
            return list(conn.execute(sql).fetchall())
    with contextlib.closing(sqlite3.connect(database, timeout=10)) as conn:
        return list(conn.execute(sql).fetchall())


def _migrated(database: str, table: str, policy: Policy) -> Any:
    """The sweeper's (and the survey's) store, its table and the effect rows' made."""
    if _is_postgres(database):
        from idemflow.stores.postgres import PostgresStore

        store: Any = PostgresStore(database, table=table, max_size=2, policy=policy)
        rows = f"CREATE TABLE {effects_table(table)} (id BIGSERIAL PRIMARY KEY, message TEXT)"
    else:
        from idemflow.stores.sqlite import SQLiteStore

        store = SQLiteStore(database, table=table, policy=policy)
        rows = f"CREATE TABLE {effects_table(table)} (id INTEGER PRIMARY KEY, message TEXT)"
    store.migrate()
    _execute(database, rows)
    return store


def _drop(database: str, table: str) -> None:
    _execute(database, f"DROP TABLE {effects_table(table)}")
    _execute(database, f"DROP TABLE {table}")


def _execute(database: str, sql: str) -> None:
    if _is_postgres(database):
        import psycopg

        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql)
        return
    with contextlib.closing(sqlite3.connect(database, timeout=10)) as conn:
        conn.execute(sql)


def _where(database: str) -> str:
    if _is_postgres(database):
        return "PostgreSQL " + database.rsplit("@", 1)[-1]
    return f"SQLite {database}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
