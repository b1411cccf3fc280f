"""
Shared timing for idemflow's throughput benchmarks.

A benchmark here never reports an absolute number alone: it compares two or
more *contenders* (the library and the raw driver issuing the same SQL) in
one process, in short slices that take turns (A B, then B A, …). Whatever
else the machine is doing at the time hits every contender about equally, so
the ratio stays meaningful on a busy 2-core box even when the absolute
figures wander.

Threads run in a :class:`Crew` that lives for the whole benchmark, so thread-
local connections (SQLite's, or a caller's own connection) are opened once
and not inside a measured slice. Asyncio contenders run as tasks on one event
loop kept by :class:`asyncio.Runner`.

Usage::

    with Crew(16) as crew:
        results = interleave(
            [Contender("raw", crew.slice(raw_op)), Contender("library", crew.slice(lib_op))],
            seconds=10,
            slices=5,
        )
    print(table([Row.compare("postgresql", "claim+complete", 16, results)]))
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "Contender",
    "Crew",
    "Measurement",
    "Row",
    "interleave",
    "parse_list",
    "table",
    "task_slice",
]

#: Runs one measured slice of the given length; returns how many operations finished in it.
SliceRunner = Callable[[float], int]

# Workers start together this long after the slice is handed out, so the
# time spent waking threads is not measured.
_START_LEAD = 0.02


@dataclass(frozen=True, slots=True)
class Contender:
    """One way of doing the operation, measured against the others."""

    name: str
    run_slice: SliceRunner


@dataclass(frozen=True, slots=True)
class Measurement:
    """Operations per second of one contender, one figure per round.

    ``cpu_seconds`` and ``operations`` (per round, when known) give the
    process CPU time per operation: unlike throughput, it hardly moves when
    other work on the machine takes the cores away, so it shows what the
    contender itself costs.
    """

    name: str
    per_round: tuple[float, ...]
    cpu_seconds: tuple[float, ...] = ()
    operations: tuple[int, ...] = ()

    @property
    def ops_per_second(self) -> float:
        """The mean over the rounds (every round lasts equally long)."""
        return statistics.fmean(self.per_round)

    @property
    def cpu_per_op(self) -> float:
        """Process CPU seconds per operation over all rounds (NaN if not measured)."""
        done = sum(self.operations)
        return sum(self.cpu_seconds) / done if done else math.nan


class Crew:
    """``size`` long-lived worker threads that run an operation in a loop, all together.

    Use :meth:`slice` to turn an operation into a :data:`SliceRunner`. An
    exception raised by the operation stops that worker's slice and is
    re-raised in the caller: a benchmark that hides errors measures nothing.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: list[queue.SimpleQueue[_Job | None]] = [
            queue.SimpleQueue() for _ in range(size)
        ]
        self._results: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(jobs,), daemon=True, name=f"crew-{i}")
            for i, jobs in enumerate(self._jobs)
        ]
        for thread in self._threads:
            thread.start()

    def slice(self, op: Callable[[], object]) -> SliceRunner:
        """Run ``op`` on every worker for ``seconds``; the operations finished in time."""

        def run(seconds: float) -> int:
            start = time.perf_counter() + _START_LEAD
            job = _Job(op, start, start + seconds)
            for jobs in self._jobs:
                jobs.put(job)
            outcomes = [self._results.get() for _ in self._jobs]
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            return sum(n for n in outcomes if isinstance(n, int))

        return run

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> Crew:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _work(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                self._results.put(job.loop())
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, re-raised there
                self._results.put(exc)


@dataclass(frozen=True, slots=True)
class _Job:
    op: Callable[[], object]
    start: float
    deadline: float

    def loop(self) -> int:
        """Run ``op`` until the deadline; count only the operations that ended before it."""
        time.sleep(max(0.0, self.start - time.perf_counter()))
        done = 0
        while True:
            self.op()
            if time.perf_counter() > self.deadline:
                return done
            done += 1


def task_slice(
    runner: asyncio.Runner, op: Callable[[], Awaitable[object]], tasks: int
) -> SliceRunner:
    """Like :meth:`Crew.slice`, for ``tasks`` asyncio tasks on ``runner``'s event loop."""

    async def one(deadline: float) -> int:
        done = 0
        while True:
            await op()
            if time.perf_counter() > deadline:
                return done
            done += 1

    async def all_tasks(seconds: float) -> int:
        deadline = time.perf_counter() + seconds
        counts = await asyncio.gather(*(one(deadline) for _ in range(tasks)))
        return sum(counts)

    return lambda seconds: runner.run(all_tasks(seconds))


def interleave(
    contenders: Sequence[Contender],
    *,
    seconds: float,
    slices: int,
    warmup: float = 0.5,
) -> dict[str, Measurement]:
    """Measure each contender for ``seconds`` in total, in ``slices`` turns.

    Round ``r`` runs the contenders rotated by ``r`` (A B, B A, …), so neither
    always goes first. Each contender first runs ``warmup`` seconds unmeasured
    (connections made, statements prepared).
    """
    for contender in contenders:
        contender.run_slice(warmup)
    length = seconds / slices
    done: dict[str, list[int]] = {c.name: [] for c in contenders}
    cpu: dict[str, list[float]] = {c.name: [] for c in contenders}
    for round_ in range(slices):
        shift = round_ % len(contenders)
        for contender in [*contenders[shift:], *contenders[:shift]]:
            started = time.process_time()
            done[contender.name].append(contender.run_slice(length))
            cpu[contender.name].append(time.process_time() - started)
    return {
        name: Measurement(name, tuple(n / length for n in ops), tuple(cpu[name]), tuple(ops))
        for name, ops in done.items()
    }


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the result table: a contender against its baseline."""

    backend: str
    path: str
    callers: str
    baseline: Measurement
    contender: Measurement

    @classmethod
    def compare(
        cls,
        backend: str,
        path: str,
        callers: int | str,
        results: dict[str, Measurement],
        baseline: str = "raw",
        contender: str = "library",
    ) -> Row:
        return cls(backend, path, str(callers), results[baseline], results[contender])

    @property
    def ratio(self) -> float:
        return self.contender.ops_per_second / self.baseline.ops_per_second

    @property
    def round_ratios(self) -> list[float]:
        """The ratio within each round: their spread shows how noisy this row was."""
        return [
            c / b for c, b in zip(self.contender.per_round, self.baseline.per_round, strict=True)
        ]


def table(
    rows: Iterable[Row],
    headers: Sequence[str] = ("raw ops/s", "library ops/s"),
    *,
    cpu: bool = False,
) -> str:
    """A Markdown table: backend, path, callers, both throughputs, the ratio.

    The ratio column is followed by the median of the per-round ratios and
    their range: a burst of load from elsewhere spoils one round, not the
    whole comparison. ``cpu=True`` adds the process CPU µs per operation of
    each side.
    """
    extra = " | CPU µs/op: baseline / contender" if cpu else ""
    lines = [
        f"| backend | path | callers | {headers[0]} | {headers[1]} | ratio "
        f"| per round: median (min–max){extra} |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if cpu else ""),
    ]
    for row in rows:
        ratios = row.round_ratios
        line = (
            f"| {row.backend} | {row.path} | {row.callers} "
            f"| {row.baseline.ops_per_second:,.0f} | {row.contender.ops_per_second:,.0f} "
            f"| {row.ratio:.2f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}–{max(ratios):.2f}) |"
        )
        if cpu:
            line += (
                f" {row.baseline.cpu_per_op * 1e6:,.0f} / {row.contender.cpu_per_op * 1e6:,.0f} |"
            )
        lines.append(line)
    return "\n".join(lines)


def parse_list(text: str) -> list[str]:
    """``"a, b,c"`` → ``["a", "b", "c"]`` (for comma-separated command-line options)."""
    return [part.strip() for part in text.split(",") if part.strip()]


async def post_over_asgi(app: Any, path: str, key: str | None, body: bytes) -> int:
    """One JSON POST straight into an ASGI app, no server or socket: its status."""
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    status = 0
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:  # the app only asks again once it has answered: the client is gone
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def lifespan(app: Any) -> Callable[[], Any]:
    """Start the app's lifespan (the store's migration); return what ends it."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started = asyncio.Event()

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: dict[str, Any]) -> None:
        if message["type"].startswith("lifespan.startup"):
            started.set()

    lifespan_scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.ensure_future(app(lifespan_scope, receive, send))
    await inbox.put({"type": "lifespan.startup"})
    await started.wait()

    async def stop() -> None:
        await inbox.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)

    return stop
