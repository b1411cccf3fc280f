"""
What idempotency costs a Django + DRF endpoint and a Flask endpoint, over HTTP.

Run::

    .venv/bin/python -m bench.bench_frameworks [--seconds 2] [--rounds 5] [--clients 1,16]
                                               [--apps django,flask]

The example shops (``examples/django_app``, ``examples/flask_app``) are started
on PostgreSQL, each on a database of its own, each under gunicorn with 2 gthread
workers of 8 threads on 127.0.0.1 (the servers the integration tests start:
``tests/integrations/test_wsgi_apps.py``). This process is the load generator: a
small asyncio HTTP/1.1 client, one keep-alive connection per concurrent client.
For each app three paths are measured, and all six take turns in short slices in
one run (``bench/_harness.py``'s ``interleave``: A B C …, then B C … A), so a noisy
neighbour hits each about equally:

``unprotected``
    the benchmark-only twin of the endpoint without idemflow: the same validation
    and payment row (Django: ``POST /_bench/drf/payments``, a DRF action in
    Django's autocommit; Flask: ``POST /_bench/payments``, committed by the view).
``protected``
    the protected endpoint with a fresh ``Idempotency-Key`` per request (Django:
    ``POST /drf/payments``, ``@idempotent`` on the DRF action; Flask:
    ``POST /payments``, ``@idem.protect``): claim, then the payment row and the
    completion in one transaction.
``replay``
    the protected endpoint with a key that already completed.

Django keeps its database connections (``CONN_MAX_AGE``), as a production
deployment would: opening a connection per request would hide idemflow's cost
behind the connection's. Targets: protected ≥ 0.80 × unprotected on PostgreSQL;
the peer figure for comparison, measured elsewhere, is drf-idempotency at 0.48.
At the end the run checks the business tables: one payment row per protected
201, none for the replays.

``--baseline TREE`` measures a change: each shop runs a second time on the idemflow of
``TREE/src`` (e.g. ``git archive main src | tar -x -C /tmp/before``), and its three
paths take turns with this tree's in the same slices (one app at a time, so two
servers), so before and after are compared in one run.

A second table gives the CPU each path costs on the server side, per request:
the gunicorn workers' (the framework, idemflow, the driver) and the PostgreSQL
backends' serving the shop's database (both read from ``/proc`` around each
slice; the server runs on this host). Unlike throughput, it hardly moves when
other work takes the cores, so it shows what protection itself costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import POSTGRES_URL
from tests.integrations.test_wsgi_apps import Shop, _django_shop, _flask_shop

from bench._harness import Contender, Measurement, Row, SliceRunner, interleave, table

PATHS = ("unprotected", "protected", "replay")
BODY = json.dumps({"amount": 1000}).encode()
TARGET = 0.80
PEER = "drf-idempotency 0.48 (PostgreSQL, measured for issue 11; not installed here)"


@dataclass(frozen=True)
class App:
    """One example shop: where its protected endpoint and its twin live."""

    name: str
    label: str
    protected: str
    unprotected: str


APPS = {
    "django": App("django", "Django+DRF", "/drf/payments", "/_bench/drf/payments"),
    "flask": App("flask", "Flask", "/payments", "/_bench/payments"),
}


def request_bytes(path: str, principal: str, key: str | None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"X-User: {principal}",
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
    ]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY


@dataclass
class Client:
    """One keep-alive HTTP/1.1 connection; reads fixed-length and chunked bodies."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, payload: bytes) -> tuple[int, bool]:
        """Send one request; its status and whether it was a replay."""
        self.writer.write(payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, chunked, replayed = 0, False, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()  # gunicorn, for Django's responses
            elif name == b"idempotent-replayed":
                replayed = value.strip() == b"true"
        if not chunked:
            await self.reader.readexactly(length)
            return status, replayed
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            await self.reader.readexactly(size + 2)  # the chunk and its CRLF
        await self.reader.readexactly(2)  # the last chunk's CRLF (no trailers)
        return status, replayed


async def open_clients(base: str, count: int) -> list[Client]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    clients = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(host, int(port))
        clients.append(Client(reader, writer))
    return clients


@dataclass
class Tally:
    """Every answer a path got, inside or outside the measured part of its slices."""

    statuses: Counter[int] = field(default_factory=Counter)
    replayed: int = 0
    #: Per measured slice: (app server CPU s, PostgreSQL backend CPU s, requests sent).
    cpu: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def cpu_per_request(self) -> tuple[float, float]:
        """Server-side CPU µs per request: the app's workers, PostgreSQL's backends."""
        measured = self.cpu[1:]  # the first slice is the harness's warm-up
        sent = sum(n for _, _, n in measured) or 1
        return (
            sum(a for a, _, _ in measured) / sent * 1e6,
            sum(d for _, d, _ in measured) / sent * 1e6,
        )

    def anomalies(self, path: str) -> str:
        """Anything but a 201, and replays flagged wrongly; empty when all went right."""
        sent = sum(self.statuses.values())
        odd = {s: n for s, n in self.statuses.items() if s != 201}
        expected = sent if path == "replay" else 0
        flags = f" replayed {self.replayed}/{sent}" if self.replayed != expected else ""
        return f"{odd}{flags}" if odd or flags else ""


def client_slice(
    runner: asyncio.Runner, clients: list[Client], make: Callable[[], bytes], tally: Tally
) -> SliceRunner:
    """A harness slice: every client sends requests back to back until the deadline."""

    async def one(client: Client, deadline: float) -> int:
        done = 0
        while True:
            status, replayed = await client.send(make())
            tally.statuses[status] += 1
            tally.replayed += replayed
            if time.perf_counter() > deadline:
                return done
            done += 1

    async def every(seconds: float) -> int:
        deadline = time.perf_counter() + seconds
        return sum(await asyncio.gather(*(one(c, deadline) for c in clients)))

    return lambda seconds: runner.run(every(seconds))


_MASTER = re.compile(r"Listening at: http://127\.0\.0\.1:\d+ \((\d+)\)")
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, …), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu_seconds(pid: int) -> float:
    fields = _proc_stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Meter:
    """The CPU of one shop's server side: its gunicorn workers and its PostgreSQL backends."""

    log: Path
    database: str
    admin: object  # a psycopg connection to the cluster, for pg_stat_activity

    def workers(self) -> list[int]:
        found = _MASTER.search(self.log.read_text())
        assert found is not None, "gunicorn's log names no master"
        master = found.group(1)
        stats = ((p, _proc_stat(int(p.name))) for p in Path("/proc").glob("[0-9]*"))
        return [int(p.name) for p, f in stats if f is not None and f[1] == master]

    def backends(self) -> list[int]:
        sql = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        return [row[0] for row in self.admin.execute(sql, (self.database,))]  # type: ignore[attr-defined]

    def snapshot(self) -> tuple[dict[int, float], dict[int, float]]:
        return (
            {pid: _cpu_seconds(pid) for pid in self.workers()},
            {pid: _cpu_seconds(pid) for pid in self.backends()},
        )


def metered(run: SliceRunner, meter: Meter, tally: Tally) -> SliceRunner:
    """``run``, recording the server side's CPU over the slice into ``tally``."""

    def delta(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())

    def slice_(seconds: float) -> int:
        (app, db), sent = meter.snapshot(), tally.sent
        done = run(seconds)
        app_after, db_after = meter.snapshot()
        tally.cpu.append((delta(app, app_after), delta(db, db_after), tally.sent - sent))
        return done

    return slice_


@dataclass
class Target:
    """A running example shop, its paths' tallies, and the principal each path writes
    as (its own, so the final check can count its rows)."""

    app: App
    shop: Shop
    replay_key: str = field(default_factory=lambda: f"bench-replay-{uuid.uuid4().hex}")
    tallies: dict[str, Tally] = field(default_factory=lambda: {p: Tally() for p in PATHS})
    principals: dict[str, str] = field(
        default_factory=lambda: {p: f"bench-{p}-{uuid.uuid4().hex[:8]}" for p in PATHS}
    )

    def makers(self) -> dict[str, Callable[[], bytes]]:
        app, who = self.app, self.principals
        return {
            "unprotected": lambda: request_bytes(app.unprotected, who["unprotected"], None),
            "protected": lambda: request_bytes(
                app.protected, who["protected"], f"bench-{uuid.uuid4().hex}"
            ),
            "replay": lambda: request_bytes(app.protected, who["replay"], self.replay_key),
        }

    def check_rows(self) -> str:
        """One payment row per protected 201 and the replayed key's one: or what differs."""
        rows = {path: self.shop.rows(who) for path, who in self.principals.items()}
        expected = {
            "unprotected": self.tallies["unprotected"].statuses[201],
            "protected": self.tallies["protected"].statuses[201],
            "replay": 1,
        }
        wrong = {p: (rows[p], expected[p]) for p in PATHS if rows[p] != expected[p]}
        return f"{self.app.label}: rows (found, expected) {wrong}" if wrong else ""


@contextlib.contextmanager
def servers(
    apps: list[str], workdir: Path, baseline: Path | None = None
) -> Iterator[dict[str, tuple[App, Shop, Meter]]]:
    """The example shops on PostgreSQL, under gunicorn: key → the app, the shop, its meter.

    With ``baseline`` (a tree holding another ``src/``, e.g. ``git archive main src``
    unpacked), each shop is started a second time on that tree's idemflow: the
    "before" contenders, keyed ``<app>-before``.
    """
    import psycopg

    # Django keeps its connections; gunicorn keeps idle client connections open while
    # the other paths' slices run (its default keep-alive is 2 s).
    os.environ["SHOP_CONN_MAX_AGE"] = "600"
    os.environ["GUNICORN_CMD_ARGS"] = "--keep-alive 600"
    trees = [("", None)] if baseline is None else [("", None), ("-before", baseline)]
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(POSTGRES_URL, autocommit=True))
        shops: dict[str, tuple[App, Shop, Meter]] = {}
        for name in apps:
            for suffix, tree in trees:
                key = name + suffix
                tmp = workdir / key
                tmp.mkdir()
                start = _django_shop if name == "django" else _flask_shop
                with _idemflow_from(tree):
                    shop = start("postgres", tmp, stack)
                database = shop.url.rsplit("/", 1)[1]
                app = APPS[name]
                if tree is not None:
                    app = App(key, f"{app.label} (before)", app.protected, app.unprotected)
                shops[key] = (app, shop, Meter(tmp / "gunicorn.log", database, admin))
        yield shops


@contextlib.contextmanager
def _idemflow_from(tree: Path | None) -> Iterator[None]:
    """Servers started meanwhile import idemflow from ``tree``'s ``src`` (None: this one's)."""
    if tree is None:
        yield
        return
    import tests.integrations.test_wsgi_apps as apps

    # The servers' PYTHONPATH starts with ROOT / "src" (tests/integrations/test_wsgi_apps.py).
    kept = apps.ROOT
    apps.ROOT = tree
    try:
        yield
    finally:
        apps.ROOT = kept


def measure(
    shops: dict[str, tuple[App, Shop, Meter]], clients_n: int, seconds: float, rounds: int
) -> tuple[dict[str, Measurement], list[Target]]:
    with asyncio.Runner() as runner:
        contenders, targets = [], []
        for name, (app, shop, meter) in shops.items():
            clients = runner.run(open_clients(shop.base, clients_n))
            target = Target(app, shop)
            seed = request_bytes(app.protected, target.principals["replay"], target.replay_key)
            assert runner.run(clients[0].send(seed)) == (201, False)
            for path, make in target.makers().items():
                tally = target.tallies[path]
                run = metered(client_slice(runner, clients, make, tally), meter, tally)
                contenders.append(Contender(f"{name}/{path}", run))
            targets.append(target)
        results = interleave(contenders, seconds=seconds * rounds, slices=rounds, warmup=0.5)
    return results, targets


def rows_for(results: dict[str, Measurement], targets: list[Target], clients: int) -> list[Row]:
    rows = []
    for target in targets:
        name, label = target.app.name, target.app.label
        for path, baseline, contender in (
            ("protected ÷ unprotected", "unprotected", "protected"),
            ("replay ÷ first execution", "protected", "replay"),
        ):
            rows.append(
                Row.compare(
                    f"{label}, PostgreSQL",
                    path,
                    clients,
                    results,
                    baseline=f"{name}/{baseline}",
                    contender=f"{name}/{contender}",
                )
            )
    return rows


CPU_HEADER = (
    "| app | clients | path | app server CPU µs/req | PostgreSQL CPU µs/req | total |\n"
    "| --- | ---: | --- | ---: | ---: | ---: |"
)


def cpu_rows(targets: list[Target], clients: int) -> list[str]:
    lines = []
    for target in targets:
        for path in PATHS:
            app, db = target.tallies[path].cpu_per_request()
            lines.append(
                f"| {target.app.label} | {clients} | {path} | {app:,.0f} | {db:,.0f} "
                f"| {app + db:,.0f} |"
            )
    return lines


def verdicts(rows: list[Row]) -> list[str]:
    lines = []
    for row in rows:
        if row.path.startswith("protected"):
            met = "met" if row.ratio >= TARGET else "MISSED"
            lines.append(
                f"{row.backend}, {row.callers} clients: protected ÷ unprotected "
                f"{row.ratio:.2f} — target ≥ {TARGET:.2f} {met}"
            )
    return [*lines, f"peer for comparison: {PEER}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rounds", type=int, default=5, help="slices per path")
    parser.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated")
    parser.add_argument("--apps", default="django,flask")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a tree holding the 'before' src/ (e.g. git archive main src, unpacked): each "
        "shop also runs on it, its paths interleaved with this tree's (one app at a time)",
    )
    args = parser.parse_args(argv)
    apps = [a for a in args.apps.split(",") if a]
    load = [os.getloadavg()[0]]
    rows: list[Row] = []
    cpu: list[str] = []
    problems: list[str] = []
    # With a baseline, one app (two servers) at a time: fewer PostgreSQL connections.
    groups = [apps] if args.baseline is None else [[app] for app in apps]
    for group in groups:
        with (
            tempfile.TemporaryDirectory() as workdir,
            servers(group, Path(workdir), args.baseline) as shops,
        ):
            for n in (int(c) for c in args.clients.split(",")):
                results, targets = measure(shops, n, args.seconds, args.rounds)
                found = rows_for(results, targets, n)
                rows += found
                cpu += cpu_rows(targets, n)
                found_table = table(found, ("baseline req/s", "measured req/s"))
                print(found_table, file=sys.stderr, flush=True)
                for target in targets:
                    problems += [
                        f"{target.app.label} {n} clients {path}: {odd}"
                        for path, tally in target.tallies.items()
                        if (odd := tally.anomalies(path))
                    ]
                    problems += [wrong for wrong in [target.check_rows()] if wrong]
                load.append(os.getloadavg()[0])
    print(table(rows, ("baseline req/s", "measured req/s")))
    print()
    print("\n".join([CPU_HEADER, *cpu]))
    print()
    for line in verdicts(rows):
        print(f"- {line}")
    print(f"- {os.cpu_count()} cores; load average (1 min) {' → '.join(f'{x:.2f}' for x in load)}")
    for problem in problems:
        print(f"- PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
