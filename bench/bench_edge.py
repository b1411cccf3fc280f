"""
What the edge costs in CPU, in one process, counted in instructions: immune to the machine's load.

Run::

    .venv/bin/python -m bench.bench_edge [--targets starlette,flask,django]
                                         [--paths unprotected,protected,replay]
                                         [--baseline TREE] [--count 200]

Each target's app is called in this process, without a server or a socket to
the client: ``starlette`` is ``bench/_minimal_app.py`` (``IdempotencyMiddleware``
on the memory store, so only idemflow's Python and Starlette's are left),
called as ASGI; ``starlette-redis`` and ``starlette-postgres`` are the same app
on the shared Redis (a key prefix of its own) and PostgreSQL (a schema of its
own): the driver's client side counts too, not the system calls nor the
server's work; ``flask`` and ``django`` are the example shops of
``bench/bench_frameworks.py`` on a PostgreSQL database of their own, called as
WSGI (their client side: the framework, idemflow, the driver; not the server's
work). Each path is run under ``valgrind --tool=callgrind`` twice, with
``--count`` and 3 × ``--count`` requests after the same warm-up (``--warmup``
requests on every path), and the
difference of the instructions executed, divided by the requests, is the
path's instructions per request: start-up and warm-up cancel out, and the
figure does not move with the load of a shared machine as CPU time does.
With ``--baseline TREE`` every figure is taken again on the idemflow of
``TREE/src`` (e.g. ``git archive main src | tar -x -C /tmp/before``).

Needs ``valgrind`` (Debian's package). ``--run TARGET PATH N`` is one
measured process (what valgrind runs).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import io
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._harness import post_over_asgi

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("unprotected", "protected", "replay")
WARMUP = 10
JSON_BODY = b'{"amount":1000,"currency":"EUR","customer":"ada"}'
REDIS_URL = os.environ.get("IDEMFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The Starlette targets: the minimal app on each store.
STARLETTE = {"starlette": "memory", "starlette-redis": "redis", "starlette-postgres": "postgres"}


# --- one measured process --------------------------------------------------------------


def starlette_caller(store: str = "memory") -> dict[str, Callable[[], int]]:
    """The minimal app on ``store``, called as ASGI: path -> one request.

    ``memory``: only idemflow's Python and Starlette's are left. ``redis`` and
    ``postgres``: the real store on the shared server (a key prefix or a schema
    of this process's own), so the driver's client side counts too (what
    ``bench_middleware`` reads as the app server's CPU, without the socket's
    system calls).
    """
    if store == "postgres":
        from bench.bench_http import postgres_schema

        schema = postgres_schema()
        os.environ["BENCH_URL"] = schema.__enter__()
        atexit.register(schema.__exit__, None, None, None)
    elif store == "redis":
        prefix = f"bench-edge:{uuid.uuid4().hex[:8]}:"
        os.environ["BENCH_URL"] = REDIS_URL
        os.environ["BENCH_PREFIX"] = prefix
        atexit.register(_forget_redis, prefix)
    if store != "memory":
        os.environ["BENCH_STORE"] = store
    import bench._minimal_app as minimal

    if store == "memory":
        from idemflow.stores.memory import AsyncMemoryStore

        minimal._store = AsyncMemoryStore  # type: ignore[assignment]
        minimal.KIND = "memory"  # nothing to migrate
        app = minimal.make_app()
    else:
        app = minimal.app  # made on import, from the environment above
    loop = asyncio.new_event_loop()
    # Closed at exit on every store (the memory store's too: an unclosed loop leaves its
    # self-pipe sockets to a ResourceWarning), before the schema or the keys go (atexit:
    # last in, first out).
    atexit.register(_stop, loop)
    if store == "postgres":
        loop.run_until_complete(_start(app))

    def call(path: str, key: str | None) -> Any:
        return post_over_asgi(app, path, key, JSON_BODY)

    replay = f"edge-replay-{uuid.uuid4().hex}"
    return {
        "unprotected": lambda: loop.run_until_complete(call("/plain/things", None)),
        "protected": lambda: loop.run_until_complete(call("/things", f"edge-{uuid.uuid4().hex}")),
        "replay": lambda: loop.run_until_complete(call("/things", replay)),
    }


async def _start(app: Any) -> None:
    """Run the app's lifespan startup (the store's migrate); its task stays parked after."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    _LIFESPANS.append(asyncio.ensure_future(app(scope, inbox.get, outbox.put)))
    answer = await outbox.get()
    assert answer["type"] == "lifespan.startup.complete", answer


_LIFESPANS: list[asyncio.Future[Any]] = []


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """End the lifespan and the pool's tasks quietly, then the loop."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))
    loop.close()


def _forget_redis(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    client.close()


def wsgi_caller(target: str) -> dict[str, Callable[[], int]]:
    """An example shop on a fresh PostgreSQL database, called as WSGI: path -> one request."""
    import psycopg
    from tests.conftest import POSTGRES_URL

    database = f"idemflow_edge_{target}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")

    def drop() -> None:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")

    atexit.register(drop)
    os.environ["SHOP_DATABASE_URL"] = POSTGRES_URL.rsplit("/", 1)[0] + f"/{database}"
    os.environ["SHOP_CONN_MAX_AGE"] = "600"
    app_dir = ROOT / "examples" / ("django_app" if target == "django" else "flask_app")
    if target == "django":
        prepare = [sys.executable, "manage.py", "migrate", "-v", "0"]
        subprocess.run(prepare, cwd=app_dir, check=True)
    else:
        flask = [sys.executable, "-m", "flask", "--app", "app"]
        subprocess.run([*flask, "init-db"], cwd=app_dir, check=True)
        subprocess.run([*flask, "idemflow", "migrate"], cwd=app_dir, check=True)
    sys.path.insert(0, str(app_dir))
    if target == "django":
        os.environ["DJANGO_SETTINGS_MODULE"] = "shop.settings"
        from shop.wsgi import application as app  # type: ignore[import-not-found]

        protected, unprotected = "/drf/payments", "/_bench/drf/payments"
    else:
        from app import app  # type: ignore[import-not-found,no-redef]

        protected, unprotected = "/payments", "/_bench/payments"
    body = b'{"amount": 1000}'

    def call(path: str, key: str | None) -> int:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": path,
            "SCRIPT_NAME": "",
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "80",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
            "wsgi.version": (1, 0),
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_HOST": "127.0.0.1",
            "HTTP_X_USER": "alice",
        }
        if key is not None:
            environ["HTTP_IDEMPOTENCY_KEY"] = key
        status: list[str] = []
        answer = app(environ, lambda line, headers, exc_info=None: status.append(line))
        b"".join(answer)
        getattr(answer, "close", lambda: None)()
        return int(status[0][:3])

    replay = f"edge-replay-{uuid.uuid4().hex}"
    return {
        "unprotected": lambda: call(unprotected, None),
        "protected": lambda: call(protected, f"edge-{uuid.uuid4().hex}"),
        "replay": lambda: call(protected, replay),
    }


def run(target: str, path: str, count: int, warmup: int = WARMUP) -> None:
    """Warm every path, then send ``count`` requests on ``path`` (what valgrind counts)."""
    store = STARLETTE.get(target)
    calls = starlette_caller(store) if store is not None else wsgi_caller(target)
    calls["replay"]()  # the replayed key's first execution
    for _ in range(warmup):
        for call in calls.values():
            assert call() in (200, 201)
    one = calls[path]
    for _ in range(count):
        assert one() in (200, 201)


# --- the measurement -------------------------------------------------------------------

_COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(target: str, path: str, count: int, tree: Path | None, warmup: int) -> int:
    """Instructions executed by one measured process (``--run``), under callgrind."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(tree / "src")] if tree is not None else []), str(ROOT), env.get("PYTHONPATH", "")]
    )
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += [sys.executable, "-m", "bench.bench_edge", "--run", target, path, str(count)]
    command += ["--warmup", str(warmup)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    found = _COLLECTED.search(done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1))


def per_request(target: str, path: str, count: int, tree: Path | None, warmup: int) -> float:
    few = instructions(target, path, count, tree, warmup)
    many = instructions(target, path, 3 * count, tree, warmup)
    return (many - few) / (2 * count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="starlette,flask,django")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--count", type=int, default=200, help="requests of the smaller run")
    parser.add_argument("--baseline", type=Path, help="a tree holding the 'before' src/")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="requests per path first")
    parser.add_argument("--run", nargs=3, metavar=("TARGET", "PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        target, path, n = args.run
        run(target, path, int(n), args.warmup)
        return 0
    trees: list[tuple[str, Path | None]] = [("after", None)]
    if args.baseline is not None:
        trees.insert(0, ("before", args.baseline))
    print("| target | path | " + " | ".join(f"{name} Ir/req" for name, _ in trees) + " | change |")
    print("| --- | --- |" + " ---: |" * (len(trees) + 1))
    for target in args.targets.split(","):
        for path in args.paths.split(","):
            figures = [
                per_request(target, path, args.count, tree, args.warmup) for _, tree in trees
            ]
            change = f"{figures[-1] / figures[0] - 1:+.0%}" if len(figures) > 1 else ""
            cells = " | ".join(f"{f:,.0f}" for f in figures)
            print(f"| {target} | {path} | {cells} | {change} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
