"""
Before / after in one run: two versions of idemflow, each against its raw driver, interleaved.

Run::

    .venv/bin/python -m bench.bench_versions [--rev main] [--backends sqlite,redis]
        [--paths claim,replay] [--callers 1,16] [--seconds N] [--slices N]

``--rev`` names the "before" tree (a git revision: its ``src/idemflow`` is
exported with ``git archive`` into a temporary directory); "after" is this
checkout's ``src``. For each backend and number of callers, one worker
process per version imports *its* idemflow (its ``src`` first on
``sys.path``) and the benchmark code of *this* checkout, and builds the
contenders of ``bench.bench_core`` (SQLite) or ``bench.bench_stores``
(Redis, MySQL/MariaDB): the library's ``Idempotency.run`` and the raw driver sending that
version's own statements or scripts with the same parameters. The
coordinator then runs one slice at a time, rotating the order every round
over all four (before raw, before library, after raw, after library), so
load from elsewhere hits every one of them alike; idle workers wait on a pipe
and take no CPU. Each slice reports its operations and the worker's own CPU
time.

The table gives, per version, library / raw (what the library costs over
its driver) and, across versions, after / before for the library (what the
change bought) and for the raw side (which should stay near 1.00: the same
statements, so a departure measures the machine, not the code).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ._harness import parse_list

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("sqlite", "redis", "mysql")
PATHS = ("claim", "replay")
#: The label of each path in the tables (as ``bench_core`` and ``bench_stores`` print them).
LABELS = {"claim": "claim+complete", "replay": "replay"}


@dataclass(frozen=True)
class Settings:
    rev: str
    backends: tuple[str, ...]
    paths: tuple[str, ...]
    callers: tuple[int, ...]
    seconds: float
    slices: int


@dataclass(frozen=True)
class Side:
    """One contender's slices: operations and worker CPU seconds per round."""

    ops: tuple[int, ...]
    cpu: tuple[float, ...]
    length: float

    @property
    def per_round(self) -> list[float]:
        return [n / self.length for n in self.ops]

    @property
    def rate(self) -> float:
        return statistics.fmean(self.per_round)

    @property
    def cpu_us(self) -> float:
        return sum(self.cpu) / max(1, sum(self.ops)) * 1e6


# --- the worker: one version, its contenders, slices on request -------------------


def worker(src: str, backend: str, callers: int, paths: Sequence[str], tag: str) -> None:
    """Serve ``slice <name> <seconds>`` on stdin with ``<ops> <cpu seconds>`` on stdout."""
    sys.path.insert(0, src)
    import idemflow

    if not Path(idemflow.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"imported {idemflow.__file__}, not the tree under {src}")
    from ._harness import Crew

    with contextlib.ExitStack() as stack:
        ops = stack.enter_context(_contenders(backend, paths, tag, callers))
        crew = stack.enter_context(Crew(callers))
        runners = {name: crew.slice(op) for name, op in ops.items()}
        for run in runners.values():
            run(0.5)  # warm up: connections opened, statements prepared
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[0] == "quit":
                break
            started = time.process_time()
            done = runners[words[1]](float(words[2]))
            print(done, time.process_time() - started, flush=True)


@contextlib.contextmanager
def _contenders(
    backend: str, paths: Sequence[str], tag: str, callers: int
) -> Iterator[dict[str, Any]]:
    if backend == "sqlite":
        with _sqlite(paths, tag) as ops:
            yield ops
    elif backend == "mysql":
        with _mysql(paths, tag, callers) as ops:
            yield ops
    else:
        with _redis(paths, tag) as ops:
            yield ops


@contextlib.contextmanager
def _sqlite(paths: Sequence[str], tag: str) -> Iterator[dict[str, Any]]:
    from idemflow import Idempotency
    from idemflow.stores.sqlite import SQLiteStore

    from . import bench_core as core

    with tempfile.TemporaryDirectory(prefix="idemflow-versions-") as folder:
        path = Path(folder) / "keys.db"
        store = SQLiteStore(path)
        store.migrate()
        idem = Idempotency(store)
        raw = core.RawSQLite(path, store.dialect)
        ops: dict[str, Any] = {}
        if "claim" in paths:
            ops["claim/raw"] = raw.claim_complete(core.Keys(tag, "raw"))
            ops["claim/library"] = core.library_claim_complete(idem, core.Keys(tag, "lib"))
        if "replay" in paths:
            done = core.prepare_replay(idem, tag)
            ops["replay/raw"] = raw.replay(done)
            ops["replay/library"] = core.library_replay(idem, done)
        try:
            yield ops
        finally:
            raw.close()
            store.close()


@contextlib.contextmanager
def _redis(paths: Sequence[str], tag: str) -> Iterator[dict[str, Any]]:
    from idemflow import Idempotency

    from . import bench_stores as stores

    prefix = f"bench-versions-{tag}"
    store = stores.redis_store(stores.REDIS_URL, False, prefix)
    try:
        yield _store_ops(stores.RawRedis(store), Idempotency(store, stores.POLICY), paths, tag)
    finally:
        for key in store.client.scan_iter(match=f"{prefix}:*", count=1000):
            store.client.delete(key)
        store.close()


@contextlib.contextmanager
def _mysql(paths: Sequence[str], tag: str, callers: int) -> Iterator[dict[str, Any]]:
    """``bench_stores``' MySQL contenders: a pool of one connection per caller, all open."""
    from idemflow import Idempotency

    from . import bench_stores as stores

    with stores.mysql_table(f"v{tag}", pool_size=callers) as (table, store):
        raw = stores.RawMySQL(table)
        try:
            yield _store_ops(raw, Idempotency(store, stores.POLICY), paths, tag)
        finally:
            raw.close()


def _store_ops(raw: Any, idem: Any, paths: Sequence[str], tag: str) -> dict[str, Any]:
    """``bench_stores``' raw and library operations on one store, per path asked for
    (the replay path's keys completed first)."""
    from . import bench_stores as stores

    done = stores.ReplayKeys(tag, "done")
    if "replay" in paths:
        for key in done.keys:
            idem.run(stores.intent(key), stores.respond)
    library = stores.library_ops(idem, stores.Keys(tag, "lib"), done)
    ops: dict[str, Any] = {}
    if "claim" in paths:
        ops["claim/raw"] = raw.claim_complete(stores.Keys(tag, "raw"))
        ops["claim/library"] = library[0]
    if "replay" in paths:
        ops["replay/raw"] = raw.replay(done)
        ops["replay/library"] = library[1]
    return ops


# --- the coordinator ------------------------------------------------------------------


class Worker:
    """A worker process of one version, driven over its pipes."""

    def __init__(self, src: Path, backend: str, callers: int, paths: Sequence[str]) -> None:
        tag = uuid.uuid4().hex[:8]
        command = [sys.executable, "-m", "bench.bench_versions", "--worker", str(src)]
        command += ["--backends", backend, "--callers", str(callers), "--paths", ",".join(paths)]
        command += ["--tag", tag]
        # The worker's own tree first: nothing of this checkout's src may shadow it.
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}"}
        self._process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self._readline() != "ready":
            raise RuntimeError(f"the worker for {src} did not start")

    def run(self, name: str, seconds: float) -> tuple[int, float]:
        self._pipe(self._process.stdin).write(f"slice {name} {seconds}\n")
        self._pipe(self._process.stdin).flush()
        ops, cpu = self._readline().split()
        return int(ops), float(cpu)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._pipe(self._process.stdin).write("quit\n")
            self._pipe(self._process.stdin).flush()
        self._process.wait(timeout=120)

    def _readline(self) -> str:
        line = self._pipe(self._process.stdout).readline()
        if not line:
            raise RuntimeError(f"a worker exited (code {self._process.wait()})")
        return line.strip()

    @staticmethod
    def _pipe(stream: IO[str] | None) -> IO[str]:
        if stream is None:
            raise RuntimeError("the worker has no pipe")
        return stream


@contextlib.contextmanager
def before_tree(rev: str) -> Iterator[Path]:
    """``src/idemflow`` of ``rev``, exported into a temporary directory; its ``src``."""
    with tempfile.TemporaryDirectory(prefix="idemflow-before-") as folder:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", rev, "src/idemflow"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        yield Path(folder) / "src"


def measure(
    settings: Settings, workers: dict[str, Worker], path: str
) -> dict[tuple[str, str], Side]:
    """Every contender of ``path`` in both versions, one slice at a time, rotated per round."""
    order = [(version, side) for version in workers for side in ("raw", "library")]
    length = settings.seconds / settings.slices
    ops: dict[tuple[str, str], list[int]] = {key: [] for key in order}
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in order}
    for round_ in range(settings.slices):
        shift = round_ % len(order)
        for version, side in [*order[shift:], *order[:shift]]:
            done, seconds = workers[version].run(f"{path}/{side}", length)
            ops[(version, side)].append(done)
            cpu[(version, side)].append(seconds)
    return {key: Side(tuple(ops[key]), tuple(cpu[key]), length) for key in order}


def ratio_cell(contender: Side, baseline: Side) -> str:
    rounds = [c / b for c, b in zip(contender.per_round, baseline.per_round, strict=True) if b]
    return (
        f"{contender.rate / baseline.rate:.2f} | {statistics.median(rounds):.2f} "
        f"({min(rounds):.2f}–{max(rounds):.2f})"
    )


HEADER = (
    "| backend | path | callers | version | raw ops/s | library ops/s | library / raw "
    "| per round: median (min–max) | CPU µs/op: raw / library |\n"
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
)
CHANGE_HEADER = (
    "| backend | path | callers | side | before ops/s | after ops/s | after / before "
    "| per round: median (min–max) | CPU µs/op: before / after |\n"
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
)


def rows(backend: str, path: str, callers: int, sides: dict[tuple[str, str], Side]) -> list[str]:
    lines = []
    for version in ("before", "after"):
        raw, lib = sides[(version, "raw")], sides[(version, "library")]
        lines.append(
            f"| {backend} | {LABELS[path]} | {callers} | {version} | {raw.rate:,.0f} "
            f"| {lib.rate:,.0f} | {ratio_cell(lib, raw)} | {raw.cpu_us:.0f} / {lib.cpu_us:.0f} |"
        )
    return lines


def change_rows(
    backend: str, path: str, callers: int, sides: dict[tuple[str, str], Side]
) -> list[str]:
    lines = []
    for side in ("library", "raw"):
        before, after = sides[("before", side)], sides[("after", side)]
        lines.append(
            f"| {backend} | {LABELS[path]} | {callers} | {side} | {before.rate:,.0f} "
            f"| {after.rate:,.0f} | {ratio_cell(after, before)} "
            f"| {before.cpu_us:.0f} / {after.cpu_us:.0f} |"
        )
    return lines


def run(settings: Settings, emit: Callable[[str], None] = print) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    emit(f"before: {settings.rev}; after: this checkout; load average at start: {load}")
    emit(
        f"{settings.slices} interleaved slices of {settings.seconds / settings.slices:g} s "
        "per contender and row, four contenders per row\n"
    )
    table, changes = [HEADER], [CHANGE_HEADER]
    with before_tree(settings.rev) as before:
        for backend in settings.backends:
            for callers in settings.callers:
                workers: dict[str, Worker] = {}
                try:
                    workers["before"] = Worker(before, backend, callers, settings.paths)
                    workers["after"] = Worker(ROOT / "src", backend, callers, settings.paths)
                    for path in settings.paths:
                        sides = measure(settings, workers, path)
                        table += rows(backend, path, callers, sides)
                        changes += change_rows(backend, path, callers, sides)
                        emit("\n".join(table[-2:]))
                finally:
                    for each in workers.values():
                        each.close()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    emit(f"\nload average at end: {load}\n\nlibrary / raw, per version:\n")
    emit("\n".join(table))
    emit("\nafter / before (the library: what changed; raw: the machine):\n")
    emit("\n".join(changes))


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_versions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rev", default="main", help="the 'before' git revision (main)")
    parser.add_argument("--backends", default="sqlite,redis", help="sqlite, redis, mysql")
    parser.add_argument("--paths", default="claim,replay", help="claim, replay (both)")
    parser.add_argument("--callers", default="1,16", help="caller threads (1,16)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per contender and row (8)")
    parser.add_argument("--slices", type=int, default=16, help="slices per contender (16)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backends, paths = tuple(parse_list(args.backends)), tuple(parse_list(args.paths))
    unknown = (set(backends) - set(BACKENDS)) | (set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown backend or path: {', '.join(sorted(unknown))}")
    settings = Settings(
        rev=args.rev,
        backends=backends,
        paths=paths,
        callers=tuple(int(n) for n in parse_list(args.callers)),
        seconds=args.seconds,
        slices=args.slices,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> None:
    settings, args = parse_args(argv)
    if args.worker:
        worker(args.worker, settings.backends[0], settings.callers[0], settings.paths, args.tag)
        return
    run(settings)


if __name__ == "__main__":
    main()
