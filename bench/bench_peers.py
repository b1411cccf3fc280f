"""
idemflow against its peers: each package protecting the same minimal endpoint, on its own store.

Run::

    .venv/bin/python -m bench.bench_peers [--seconds 2] [--rounds 5] [--clients 1,16]
                                          [--peers NAME,…] [--venvs DIR] [--python EXE]
                                          [--only-behaviour | --turns]

Every target serves ``bench/bench_middleware.py``'s minimal endpoint under uvicorn (one
worker, its own process): ``POST /things`` protected, ``POST /plain/things`` the same
handler unprotected. idemflow's is ``bench/_minimal_app.py``; each peer's is a module of
``bench/peers/`` written against that peer's public API, run in a virtualenv of its own
(``--venvs``, made on first use with the pinned requirements of :data:`PEERS`, so the
peers' dependencies never touch this tree's). idemflow and every peer on the same store
take turns in short slices in one run (three paths each: ``unprotected``, ``protected``
with a fresh key, ``replay`` of a completed key), so whatever the machine does hits all
of them alike; the figures are those of ``bench_middleware``: throughput, protected ÷
unprotected, replay ÷ first, and the CPU per request of the app's process and of the
store (PostgreSQL's backends serving that app, or the Redis server).

Before timing, each target answers a few questions from outside (:func:`behaviour`): is
a replay the first response, status and body; what does a key reused with another body
get; what do eight requests with one key at the same instant get, and how often does
the handler run for them. Speed is only comparable between targets that answer them
alike: see ``docs/benchmarks.md``. ``--only-behaviour`` stops there; ``--turns`` instead
calls each app in process (``bench/_loop_turns.py``): event-loop iterations and CPU per
request. ``--python`` runs every target on another interpreter (e.g. Python 3.12),
idemflow's too: its app in a virtualenv of its own with this tree's ``src``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.bench_http import Client, open_clients
from bench.bench_middleware import (
    BODY,
    PATHS,
    Server,
    print_timed,
    request_bytes,
    server,
    store_settings,
    timed,
    timing_options,
)

ROOT = Path(__file__).resolve().parents[1]
MINIMAL_APP = "bench._minimal_app:app"  # idemflow's


@dataclass(frozen=True)
class Peer:
    """One package as a target: its app module, its store and its environment."""

    name: str
    app: str  # uvicorn's APP, e.g. bench.peers.peer_pyidempotent:app
    store: str  # "redis" or "postgres"
    requirements: tuple[str, ...]

    @property
    def slug(self) -> str:
        return self.app.partition(":")[0].rpartition(".")[2]


# What most peers' apps need besides the peer (Starlette under uvicorn), pinned.
_SERVER = ("anyio==4.16.0", "click==8.5.1", "h11==0.16.0", "idna==3.20", "starlette==1.10.0")
_SERVER += ("typing_extensions==4.16.0", "uvicorn==0.55.0")
_IDEMKIT = ("idemkit==1.0.2", "asyncpg==0.32.0", "redis==8.1.0", *_SERVER)

_PYDANTIC = ("annotated-types==0.8.0", "pydantic==2.14.4", "pydantic_core==2.50.5")
_PYDANTIC += ("typing-inspection==0.4.5",)

#: Every peer measured, pinned (what was installed when its app was written).
PEERS: tuple[Peer, ...] = (
    Peer(
        "asgi-idempotency-header 0.2.0",
        "bench.peers.peer_asgi_idempotency_header:app",
        "redis",
        # It imports fastapi.responses and wants fastapi<0.71: Starlette 0.16, pydantic 1.
        (
            "asgi-idempotency-header==0.2.0",
            "fastapi==0.70.1",
            "starlette==0.16.0",
            "pydantic==1.10.27",
            "redis==4.6.0",
            "anyio==3.7.1",
            "sniffio==1.3.1",
            "click==8.5.1",
            "h11==0.16.0",
            "idna==3.20",
            "typing_extensions==4.16.0",
            "uvicorn==0.55.0",
        ),
    ),
    Peer(
        "fastapi-idempotency-key 0.1.1",
        "bench.peers.peer_fastapi_idempotency_key:app",
        "redis",
        ("fastapi-idempotency-key==0.1.1", "redis==8.1.0", *_SERVER),
    ),
    Peer(
        "idempotency-kit 0.5.0",
        "bench.peers.peer_idempotency_kit:app",
        "redis",
        ("idempotency-kit==0.5.0", "orjson==3.13.0", "redis==8.1.0", *_PYDANTIC, *_SERVER),
    ),
    Peer(
        "pyidempotent 0.1.0",
        "bench.peers.peer_pyidempotent:app",
        "redis",
        (
            "pyidempotent==0.1.0",
            "fastapi==0.165.0",
            "annotated-doc==0.0.7",
            "opentelemetry-api==1.45.2",
            "redis==8.1.0",
            *_PYDANTIC,
            *_SERVER,
        ),
    ),
    Peer("idemkit 1.0.2", "bench.peers.peer_idemkit:app", "postgres", _IDEMKIT),
    Peer("idemkit 1.0.2", "bench.peers.peer_idemkit:app", "redis", _IDEMKIT),
    Peer(
        "fastapi-idempotency 0.1.1",
        "bench.peers.peer_fastapi_idempotency:app",
        "postgres",
        (
            "fastapi-idempotency==0.1.1",
            "tortoise-orm==1.1.9",
            "pypika-tortoise==0.6.5",
            "aiosqlite==0.22.1",
            "asyncpg==0.32.0",
            "iso8601==2.1.0",
            *_SERVER,
        ),
    ),
    Peer(
        "Powertools 3.37.0",
        "bench.peers.peer_powertools_redis:app",
        "redis",
        (
            "aws_lambda_powertools==3.37.0",
            "boto3==1.44.8",
            "botocore==1.44.8",
            "jmespath==1.1.0",
            "python-dateutil==2.9.0.post0",
            "s3transfer==0.19.3",
            "six==1.17.0",
            "urllib3==2.8.0",
            "redis==8.1.0",
            *_SERVER,
        ),
    ),
)


#: What idemflow's app imports besides idemflow in another interpreter (``--python``);
#: idemflow's ``src`` comes from this tree (``PYTHONPATH``).
IDEMFLOW_REQUIREMENTS = (
    "psycopg==3.3.9",
    "psycopg-binary==3.3.9",
    "psycopg-pool==3.3.3",
    "redis==8.1.0",
    *_SERVER,
)


def environment(
    slug: str, requirements: tuple[str, ...], venvs: Path, interpreter: str | None
) -> str:
    """The interpreter of the virtualenv ``slug``, made (or remade) for ``requirements``.

    On ``interpreter`` (e.g. ``python3.12``) if given, else on this one.
    """
    venv = venvs / (slug if interpreter is None else f"{slug}-{Path(interpreter).name}")
    python = venv / "bin" / "python"
    wanted = "\n".join(requirements) + "\n"
    marker = venv / "bench-requirements.txt"
    if not marker.exists() or marker.read_text() != wanted:
        base = sys.executable if interpreter is None else interpreter
        subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-qq", "--disable-pip-version-check"]
        subprocess.run([*pip, *requirements], check=True)
        marker.write_text(wanted)
    return str(python)


#: Requests sent with one new key at the same instant.
RACERS = 8


@dataclass(frozen=True)
class Behaviour:
    replay: str  # "verbatim", or how the replay differs from the first response
    reused_key: int  # the status of the same key with another body
    simultaneous: str  # RACERS requests with one new key at the same instant

    def row(self, name: str) -> str:
        return f"| {name} | {self.replay} | {self.reused_key} | {self.simultaneous} |"


async def behaviour(target: Server) -> Behaviour:
    """What ``target`` answers a retry, a reused key and a race, asked over HTTP.

    Every app's handler numbers its executions in the body's id, so a second
    execution shows as a body of its own.
    """
    other = BODY.replace(b"1000", b"2000")
    async with httpx.AsyncClient(base_url=target.url, timeout=10) as client:

        async def post(key: str, body: bytes = BODY) -> httpx.Response:
            headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
            return await client.post("/things", content=body, headers=headers)

        key = f"probe-{uuid.uuid4().hex}"
        first, replay = await post(key), await post(key)
        reused = await post(key, other)
    return Behaviour(differences(first, replay), reused.status_code, race(await at_once(target)))


def differences(first: httpx.Response, replay: httpx.Response) -> str:
    if replay.status_code != first.status_code:
        return f"status {replay.status_code}"
    if replay.content == first.content:
        return "verbatim"
    if replay.json() == first.json():
        return "same JSON, other bytes"
    return "another execution" if replay.json().get("id") != first.json().get("id") else "other"


async def at_once(target: Server) -> list[tuple[int, bytes]]:
    """:data:`RACERS` requests with one new key, written at once on connections already open.

    As many requests with keys of their own go first: they open the app's pool
    connections, which would otherwise make the racers' claims wait for their
    connects while the first one completes (every racer then a replay).
    """
    clients = await open_clients(target.url, RACERS)
    await each_at_once(clients, [new_request() for _ in clients])
    answers = await each_at_once(clients, [new_request()] * RACERS)
    for client in clients:
        client.writer.close()
    return answers


def new_request() -> bytes:
    return request_bytes("/things", f"probe-{uuid.uuid4().hex}")


async def each_at_once(clients: list[Client], requests: list[bytes]) -> list[tuple[int, bytes]]:
    """Every request written before any answer is read."""
    for client, request in zip(clients, requests, strict=True):
        client.writer.write(request)
    return [await client.answer() for client in clients]


def race(answers: list[tuple[int, bytes]]) -> str:
    statuses = Counter(status for status, _ in answers)
    executed = {json.loads(body).get("id") for status, body in answers if status < 300}
    counts = ", ".join(f"{count} × {status}" for status, count in sorted(statuses.items()))
    return f"{counts}; executed {len(executed)} ×"


@dataclass(frozen=True)
class App:
    """A target to start: its app, the interpreter it runs on, and where its idemflow is."""

    name: str
    app: str
    python: str
    tree: Path | None = None  # a tree whose src/ goes first on PYTHONPATH


def idemflow_app(venvs: Path, interpreter: str | None) -> App:
    """idemflow's minimal app: in this environment, or on ``interpreter`` with this ``src``."""
    if interpreter is None:
        return App("idemflow", MINIMAL_APP, sys.executable)
    python = environment("idemflow", IDEMFLOW_REQUIREMENTS, venvs, interpreter)
    return App("idemflow", MINIMAL_APP, python, ROOT)


def loop_turns(name: str, target: App, settings: dict[str, str]) -> str:
    """A table row: ``target``'s loop iterations and CPU per request, in its own interpreter."""
    command = [target.python, "-m", "bench._loop_turns", target.app.partition(":")[0]]
    env = {**os.environ, **settings}  # -m from ROOT: bench imports from this tree
    if target.tree is not None:
        env["PYTHONPATH"] = str(target.tree / "src")
    out = subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True, text=True)
    per_path = json.loads(out.stdout)
    iterations = ", ".join(f"{per_path[path][0]:.1f}" for path in PATHS)
    cpu = ", ".join(f"{per_path[path][1]:,.0f}" for path in PATHS)
    odd = [f"{path}: {per_path[path][2]}" for path in PATHS if per_path[path][2] != [201]]
    if odd:  # a path that did not answer 201 (fastapi-idempotency-key's replay: 422)
        name += f" (answered {', '.join(odd)})"
    return f"| {name} | {iterations} | {cpu} |"


def main(argv: list[str] | None = None) -> int:
    parser = timing_options(__doc__)
    parser.add_argument("--peers", help="peer names (slugs), comma-separated; all by default")
    parser.add_argument(
        "--venvs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "idemflow-bench-peers",
        help="where the peers' virtualenvs live (made on first use)",
    )
    parser.add_argument(
        "--python",
        help="an interpreter (e.g. python3.12) for every target, idemflow's included: each "
        "gets a virtualenv of its own on it",
    )
    parser.add_argument("--only-behaviour", action="store_true", help="the answers, no timing")
    parser.add_argument(
        "--turns",
        action="store_true",
        help="instead: each app called in process (bench/_loop_turns.py), its event-loop "
        "iterations and CPU per request",
    )
    args = parser.parse_args(argv)
    chosen = set(args.peers.split(",")) if args.peers else None
    peers = [peer for peer in PEERS if chosen is None or peer.slug in chosen]
    throughput, cpu, answers, turns = [], [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for store in dict.fromkeys(peer.store for peer in peers):
            apps = [idemflow_app(args.venvs, args.python)]
            for peer in (peer for peer in peers if peer.store == store):
                python = environment(peer.slug, peer.requirements, args.venvs, args.python)
                apps.append(App(peer.name, peer.app, python))
            names = [f"{one.name} ({store})" for one in apps]
            if args.turns:
                for name, one in zip(names, apps, strict=True):
                    with store_settings(store, Path(workdir)) as settings:
                        turns.append(loop_turns(name, one, settings))
                continue
            with contextlib.ExitStack() as stack:
                targets = []
                for one in apps:  # each with a schema or prefix of its own
                    own = stack.enter_context(store_settings(store, Path(workdir)))
                    started = server(own, tree=one.tree, app=one.app, python=one.python)
                    targets.append(stack.enter_context(started))
                for name, target in zip(names, targets, strict=True):
                    answers.append(asyncio.run(behaviour(target)).row(name))
                if not args.only_behaviour:
                    timed(names, targets, args, throughput, cpu)
    if turns:
        print(
            "| target | event-loop iterations per request: unprotected, protected, replay "
            "| CPU µs per request, in process: unprotected, protected, replay |"
        )
        print("| --- | ---: | ---: |")
        print("\n".join(turns))
        return 0
    print(f"| target | replay | same key, other body | same key, {RACERS} at once |")
    print("| --- | --- | ---: | ---: |")
    print("\n".join(answers))
    print()
    print_timed("target", throughput, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
