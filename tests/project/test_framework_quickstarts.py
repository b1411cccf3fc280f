"""
Each framework page's quick start, run as written: in a fresh virtual
environment holding only what the page's install line installs (idemflow
from this checkout, with that line's extras): FastAPI and Flask served by a
real server on PostgreSQL, Django's (its settings and view, in a project the
test makes around them) through Django's test client on SQLite. A quick start
that imports what its line does not install fails here, not in a reader's
terminal.

One environment per page, made once (pip's cache keeps it cheap), all at
once; the file is marked slow so it starts first, beside the other files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import POSTGRES_URL, unreachable

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
INSTALL = re.compile(r"`pip install (?P<args>[^`]+)`")
QUICK_START = re.compile(r"^## Quick start.*?^```python\n(?P<code>.*?)^```", re.M | re.S)
FILE_HEADING = re.compile(r"^# ([\w/]+\.py)\b.*\n", re.M)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Page:
    name: str
    #: Run in the environment, in the app's directory, before the server starts.
    setup: tuple[tuple[str, ...], ...]
    serve: tuple[str, ...]
    path: str
    body: dict[str, object]
    other: dict[str, object]
    table: str
    #: The page (``name`` by default), which of its install lines, and the files its
    #: other blocks add to the quick start (by their ``# path.py`` heading).
    doc: str = ""
    install: int = 0
    blocks: tuple[str, ...] = ()
    #: A directory of files the page's parts are appended to (a Django project).
    scaffold: Path | None = None

    @property
    def text(self) -> str:
        return (ROOT / "docs" / "frameworks" / f"{self.doc or self.name}.md").read_text()

    def install_args(self, wheel: Path) -> list[str]:
        """The page's install line, idemflow taken from this checkout's ``wheel``."""
        found = list(INSTALL.finditer(self.text))
        assert len(found) > self.install, f"{self.name}: no install line {self.install}"
        args = shlex.split(found[self.install]["args"])
        return [re.sub(r"^idemflow(?=\[|$)", str(wheel), arg) for arg in args]

    def code(self) -> str:
        found = QUICK_START.search(self.text)
        assert found is not None, f"{self.name}.md has no quick start"
        return found["code"]

    def files(self) -> dict[str, str]:
        """The quick start's parts by the file each names (``# payments/views.py``);
        ``app.py`` when it names none."""
        parts = FILE_HEADING.split(self.code())
        if len(parts) == 1:
            return {"app.py": parts[0]}
        found = dict(zip(parts[1::2], parts[2::2], strict=True))
        for block in BLOCK.findall(self.text):
            named = FILE_HEADING.split(block)
            if len(named) == 3 and named[1] in self.blocks:
                found[named[1]] = named[2]
        assert sorted(self.blocks) == sorted(set(found) & set(self.blocks)), self.blocks
        return found


CREATE_TABLES = (
    "import asyncio, app\n"
    "async def main():\n"
    "    async with app.engine.begin() as c:\n"
    "        await c.run_sync(app.Base.metadata.create_all)\n"
    "asyncio.run(main())\n"
)
PAGES = [
    Page(
        "fastapi",
        setup=(("idemflow", "migrate", "{keys}"), ("python", "-c", CREATE_TABLES)),
        serve=("uvicorn", "app:app", "--port", "{port}"),
        path="/orders",
        body={"item": "book", "quantity": 2},
        other={"item": "pen", "quantity": 1},
        table="orders",
    ),
    Page(
        "flask",
        setup=(
            ("flask", "--app", "app", "idemflow", "migrate"),
            ("python", "-c", "import app\nwith app.app.app_context(): app.db.create_all()"),
        ),
        serve=("flask", "--app", "app", "run", "--port", "{port}"),
        path="/payments",
        body={"amount": 1000},
        other={"amount": 5},
        table="payments",
    ),
]


#: The Django project the page's settings line and files are put in.
DJANGO_PROJECT = Path(__file__).with_name("django_quickstart")
DJANGO = [
    Page("django", (), (), "/payments", {}, {}, "", scaffold=DJANGO_PROJECT),
    Page(
        "drf",
        (),
        (),
        "/drf/payments",
        {},
        {},
        "",
        doc="django",
        install=1,
        blocks=("payments/api.py",),
        scaffold=DJANGO_PROJECT,
    ),
]


def build_wheel(where: Path) -> Path:
    """idemflow's wheel from this checkout, built once for every environment (with this
    interpreter's hatchling when it has one: no build environment to make)."""
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation]
    subprocess.run(
        [*pip_wheel, "--wheel-dir", str(where), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = where.glob("idemflow-*.whl")
    return wheel


def make_environment(page: Page, where: Path, wheel: Path) -> Path:
    """A virtual environment with exactly the page's install line installed (by this
    interpreter's pip: a venv made without its own pip is made in a moment)."""
    where.mkdir(parents=True)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    done = subprocess.run(
        [*pip, "install", "--quiet", *page.install_args(wheel)],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scaffold = {}
    if page.scaffold is not None:
        for made in page.scaffold.rglob("*.py"):
            scaffold[str(made.relative_to(page.scaffold))] = made.read_text()
    files = {
        **scaffold,
        **{name: scaffold.get(name, "") + text for name, text in page.files().items()},
    }
    for name, text in files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)
    return where


@pytest.fixture(scope="module")
def environments(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("quickstarts")
    wheel = build_wheel(base / "dist")
    every = [*PAGES, *DJANGO]
    with concurrent.futures.ThreadPoolExecutor(len(every)) as pool:
        made = {p.name: pool.submit(make_environment, p, base / p.name, wheel) for p in every}
        return {name: future.result() for name, future in made.items()}


@pytest.fixture
def schema() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    name = f"quick_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {name}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


@contextlib.contextmanager
def served(page: Page, where: Path, schema: str) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    database = keys.replace("postgresql://", "postgresql+psycopg://", 1)
    env = {**os.environ, "DATABASE_URL": database, "PYTHONPATH": ""}
    bin_dir = where / "venv" / "bin"

    def command(words: tuple[str, ...]) -> list[str]:
        filled = [w.format(keys=keys, port=port) for w in words]
        return [str(bin_dir / filled[0]), *filled[1:]]

    for step in page.setup:
        done = subprocess.run(
            command(step),
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{step}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    log = where / f"server-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command(page.serve), cwd=where, env=env, stderr=out, stdout=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url + "/", timeout=1)
                break
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_quick_start_runs_as_written_with_only_its_install_line(
    page: Page, environments: dict[str, Path], schema: str
) -> None:
    """Ten concurrent requests with one key make one row; the replay is the first answer,
    byte for byte; the key with another body is a 422; a caller nobody names is a 401."""
    import psycopg

    headers = {"Authorization": "alice", "Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    with (
        served(page, environments[page.name], schema) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(
                pool.map(
                    lambda _: client.post(page.path, json=page.body, headers=headers), range(10)
                )
            )
        first = client.post(page.path, json=page.body, headers=headers)
        other = client.post(page.path, json=page.other, headers=headers)
        nobody = client.post(page.path, json=page.body, headers={"Idempotency-Key": "k"})
    assert {a.status_code for a in answers} <= {201, 409}
    assert first.status_code == 201
    assert first.headers["idempotent-replayed"] == "true"
    assert all(a.content == first.content for a in answers if a.status_code == 201)
    assert other.status_code == 422
    assert nobody.status_code == 401
    with psycopg.connect(POSTGRES_URL) as conn:
        rows = conn.execute(f"SELECT count(*) FROM {schema}.{page.table}").fetchone()
    assert rows == (1,)


@pytest.mark.parametrize("page", DJANGO, ids=lambda p: p.name)
def test_the_django_quick_start_runs_as_written_with_only_its_install_line(
    page: Page, environments: dict[str, Path]
) -> None:
    """The page's settings line and view (and, with DRF's install line, its viewset) in a
    minimal project, migrated on SQLite (the key table by idemflow's migration), through
    Django's test client: a 201, its replay the same bytes with ``Idempotent-Replayed``,
    the key with another body a 422, an anonymous caller a 401. An invalid body: the
    function view (no validation) runs it, and its key is then bound to it (422); DRF's
    serializer refuses it (400), and the corrected body under that key runs once."""
    where = environments[page.name]
    done = subprocess.run(
        [str(where / "venv" / "bin" / "python"), "check.py", page.path],
        cwd=where,
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    first, replay, other, nobody = (answers[k] for k in ("first", "replay", "other", "nobody"))
    assert first[:2] == [201, None], first
    assert replay == [201, "true", first[2]]
    assert other[0] == 422, other
    assert nobody[0] == 401, nobody
    invalid, fixed = answers["invalid"], answers["fixed"]
    if page.name == "drf":
        assert invalid[0] == 400, invalid
        assert "greater than or equal to 1" in json.loads(invalid[2])["detail"]
        assert fixed[:2] == [201, None], fixed
        assert answers["rows"] == [7, 1000]
    else:
        assert (invalid[0], fixed[0]) == (201, 422)
        assert answers["rows"] == [0, 1000]
