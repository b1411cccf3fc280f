"""
The demo and the storm (``idemflow_demo``) use only idemflow's public API.

What they need, an application needs too: a private import in them means the
public API is missing something, and it is added there instead. Every module
of the package is parsed, not imported (so no framework or driver is needed),
and every import of idemflow in it, at any depth (in functions, under
``TYPE_CHECKING``), is checked:

- no module with a private part (``idemflow._http``, ``idemflow.stores._sql``);
- no name starting with ``_`` (``from idemflow.stores.sqlite import _Connections``);
- a name taken from a module that declares ``__all__`` is listed in it;
- no private attribute of an imported idemflow module (``idemflow._model.Record``);
- relative imports stay inside ``idemflow_demo``.

The other way round, the library does not depend on the demo: only the two
CLI loaders name it, building the command line imports no framework, the
library's wheel carries no demo, and without the demo installed its commands
say how to install it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import idemflow
import idemflow_demo

DEMO = Path(idemflow_demo.__file__).parent
LIBRARY = Path(idemflow.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(DEMO.rglob("*.py"))

#: The only module of the library that may name the demo: the CLI, which loads its commands.
LOADERS = {"cli/__init__.py"}


def module_name(path: Path) -> str:
    """``…/idemflow_demo/storm/config.py`` → ``idemflow_demo.storm.config``."""
    parts = path.relative_to(DEMO.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_idemflow(module: str) -> bool:
    return module == "idemflow" or module.startswith("idemflow.")


def private_part(module: str) -> str | None:
    return next((part for part in module.split(".") if part.startswith("_")), None)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str | None:
    """The absolute module a ``from … import`` names; None when it climbs out of the package."""
    if node.level == 0:
        return node.module or ""
    package = here.split(".") if is_package else here.split(".")[:-1]
    if node.level > len(package):
        return None
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def name_problem(module: str, name: str) -> str | None:
    """Why ``from module import name`` is not public API, or None."""
    if is_private(name):
        return f"private name {name}"
    if spec(module) is None:
        return f"no module {module}"
    if _is_package(module) and spec(f"{module}.{name}") is not None:
        return None  # a public submodule, checked where it is imported from
    exported = getattr(importlib.import_module(module), "__all__", None)
    if exported is not None and name not in exported:
        return f"{name} is not in {module}.__all__"
    return None


def spec(module: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent that does not exist
        return None


def _is_package(module: str) -> bool:
    found = spec(module)
    return found is not None and found.submodule_search_locations is not None


def violations(source: str, here: str, *, is_package: bool = False) -> list[str]:
    """Every use of idemflow's private API in ``source`` (a module named ``here``)."""
    found: list[str] = []
    aliases: set[str] = set()  # local names bound to an idemflow module
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not is_idemflow(alias.name):
                    continue
                if part := private_part(alias.name):
                    found.append(f"{line}: import {alias.name} (private module part {part})")
                aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node, here, is_package)
            if module is None:
                found.append(f"{line}: relative import leaves idemflow_demo")
                continue
            if not is_idemflow(module):
                continue
            if part := private_part(module):
                found.append(f"{line}: from {module} import … (private module part {part})")
                continue
            for alias in node.names:
                if problem := name_problem(module, alias.name):
                    found.append(f"{line}: from {module} import {alias.name} ({problem})")
                elif _is_package(module) and spec(f"{module}.{alias.name}") is not None:
                    aliases.add(alias.asname or alias.name)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{node.lineno}: {ast.unparse(node)} (private attribute)")
    return found


def test_the_demo_is_a_package_of_its_own() -> None:
    """The demo and the storm are a distribution of their own (``demo/``), not the library's."""
    assert DEMO.parent == ROOT / "demo" / "src"
    assert {module_name(path) for path in MODULES} >= {
        "idemflow_demo",
        "idemflow_demo.app",
        "idemflow_demo.faults",
        "idemflow_demo.storm",
        "idemflow_demo.storm.run",
    }
    assert not (LIBRARY / "demo").exists()
    assert not (LIBRARY / "_storm").exists()


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_every_demo_module_imports_only_the_public_api(path: Path) -> None:
    """No import of a private module, a private name, or a name its module does not export."""
    here = module_name(path)
    found = violations(path.read_text(), here, is_package=path.name == "__init__.py")

    assert found == [], f"{here} uses idemflow's private API:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from .._http import problem",  # what idemflow/demo/app.py used to write
        "from idemflow._http import problem",
        "from idemflow._async.edge import pooled_transaction",
        "from idemflow.stores._sql import row_mapping",
        "import idemflow._model",
        "import idemflow._model as model",
        "from idemflow.stores.sqlite import _Connections",
        # a public module, a name its __all__ does not list:
        "from idemflow.stores.postgres import is_lock_timeout",
        "import idemflow\nidemflow._model.Record",
        "from idemflow import stores\nstores._sql.row_mapping",
        "def f():\n    from idemflow._errors import ConfigurationError",
        "if TYPE_CHECKING:\n    from idemflow._model import Record",
    ],
)
def test_the_check_catches_each_kind_of_private_import(source: str) -> None:
    """Each way of reaching past the public API is caught (the check itself can fail)."""
    assert violations(source, "idemflow_demo.app") != []


@pytest.mark.parametrize(
    "source",
    [
        "from idemflow import ConfigurationError, Policy",
        "from idemflow.integrations.starlette import pooled_transaction, problem, problem_for",
        "from idemflow.transactions import AsyncSQLite3Transaction",
        "from idemflow.stores.sqlite import is_unavailable as sqlite_unavailable",
        "from idemflow import stores\nstores.sqlite",
        "from ..settings import SHUTDOWN_MARGIN",
        "from .config import StormConfig",
        "import httpx\nhttpx._private",
    ],
)
def test_the_check_lets_the_public_api_through(source: str) -> None:
    assert violations(source, "idemflow_demo.storm.config") == []


def test_the_library_names_the_demo_only_in_its_cli_loaders() -> None:
    """The library does not depend on the demo: ``import idemflow`` never reaches it."""
    naming = {
        path.relative_to(LIBRARY).as_posix()
        for path in LIBRARY.rglob("*.py")
        if "idemflow_demo" in path.read_text()
    }

    assert naming == LOADERS


PROBE = """
import json, sys
from idemflow.cli import build_parser
build_parser()
print(json.dumps(sorted(sys.modules)))
"""

#: What the demo's app and the storm bring in when they run, never before.
HEAVY = ("starlette", "uvicorn", "httpx", "prometheus_client", "rich", "psycopg", "psycopg_pool")


def test_the_command_line_loads_the_demo_lazily() -> None:
    """``idemflow --help`` registers the demo's and the storm's arguments; nothing heavy comes."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    modules: list[str] = json.loads(done.stdout)

    assert {"idemflow_demo.cli", "idemflow_demo.storm.cli"} <= set(modules)
    loaded = [m for m in modules if m.split(".")[0] in HEAVY]
    assert loaded == []
    assert "idemflow_demo.app" not in modules
    assert "idemflow_demo.storm.run" not in modules


def test_the_library_wheel_carries_no_demo(tmp_path: Path) -> None:
    """The wheel built from pyproject.toml holds the library alone: no demo, no test hook."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("idemflow-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}

    assert "idemflow" in tops
    assert {top for top in tops if not top.startswith("idemflow-")} == {"idemflow"}


WITHOUT_THE_DEMO = """
import sys
from idemflow.cli import main

class NoDemo:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "idemflow_demo":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoDemo())
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv", [["demo"], ["storm", "--port", "8000"], ["consumer-storm"], ["demo", "--help"]]
)
def test_without_the_demo_its_commands_say_how_to_install_it(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_DEMO, *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"idemflow {argv[0]}: the demo is its own distribution")
    assert "scripts/demo" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_demo_tells_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``scripts/demo --version`` (``idemflow demo --version``) prints both distributions'."""
    from idemflow.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", "--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("idemflow-demo ")
