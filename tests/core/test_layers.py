"""
The house's layers, checked on the import graph of ``src/idemflow``.

A private module (a name starting with ``_``) belongs to its package: only
modules of that package (and of its subpackages) import it. So a store never
reaches into another store's internals (``stores/postgres`` may use
``stores.sql``, never ``stores.sql._async``), and the CLI, ``metrics`` and
``transactions`` ask stores through their public modules. The root package's
private modules are the core's: the drivers, edge and sweeper (``_async``,
``_sync``) and the root modules use them freely; every other package may use
only the kernel below (the vocabulary every ``idemflow`` name is re-exported
from). Integrations take the HTTP edge from :mod:`idemflow.edge`, never from
``idemflow._http``, ``idemflow._sync`` or ``idemflow._async``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "idemflow"

#: Root-private modules every layer may import, and why.
KERNEL = {
    "idemflow._model": "Record, State, Policy…: re-exported by idemflow, the shared vocabulary; "
    "lease tokens, which every store that claims must mint alike",
    "idemflow._errors": "the one exception tree, re-exported by idemflow",
    "idemflow._extras": "optional(): the one missing-extra hint, around every optional import",
    "idemflow._process": "this process's id, kept current at fork, for stores' own connections",
    "idemflow._deprecation": "moved(): public names that moved, importable with a warning",
}

#: Known arrows past this rule, each with its reason; the test fails when one
#: disappears too, so the list only shrinks.
EXCEPTIONS = {
    (
        "idemflow.client._keys",
        "idemflow._identity",
    ): "the client checks keys by the server's grammar",
}


def module_name(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def package_of(path: Path) -> tuple[str, ...]:
    name = module_name(path)
    return name if path.name == "__init__.py" else name[:-1]


def imports(path: Path, *, private_names: bool = True) -> set[tuple[str, ...]]:
    """Every module ``path`` imports, absolute; ``from x import name`` counts x.name too
    (with ``private_names``, a ``_name`` as its package's: see below)."""
    found: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {tuple(alias.name.split(".")) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package_of(path)[: len(package_of(path)) - node.level + 1] if node.level else ()
            module = base + tuple((node.module or "").split(".") if node.module else ())
            found.add(module)
            # A private name belongs to the package it is defined in: ``from .. import
            # _sync`` names a subpackage, ``from .starlette import _helper`` a name of
            # the integrations package.
            owner = module if SRC.joinpath(*module).is_dir() else module[:-1]
            if private_names:
                found |= {(*owner, a.name) for a in node.names if a.name.startswith("_")}
    return {name for name in found if name and name[0] == "idemflow"}


def is_core(name: tuple[str, ...]) -> bool:
    """Root modules and the I/O shells: the core, which owns the root's private modules."""
    return len(name) <= 2 or name[1] in ("_async", "_sync")


def violation(importer: tuple[str, ...], imported: tuple[str, ...]) -> str | None:
    private = next((i for i, part in enumerate(imported) if part.startswith("_")), None)
    if private is None or imported[private].startswith("__"):
        return None
    owner = imported[:private]
    if importer[: len(owner)] != owner:
        return f"{'.'.join(importer)} imports {'.'.join(imported)}, private to {'.'.join(owner)}"
    if owner == ("idemflow",) and not is_core(importer):
        if ".".join(imported[:2]) in KERNEL:
            return None
        return f"{'.'.join(importer)} imports {'.'.join(imported)}, private to the core"
    return None


def arrows() -> dict[tuple[str, str], str]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in imports(path):
            message = violation(importer, imported)
            if message is not None:
                found[
                    ".".join(importer), ".".join(imported[:2] if len(imported) > 1 else imported)
                ] = message
    return found


def test_no_arrow_into_another_package_s_private_module() -> None:
    """The layers hold: what is private is used by its own package (or, the kernel, by all)."""
    unexpected = {pair: why for pair, why in arrows().items() if pair not in EXCEPTIONS}

    assert unexpected == {}


def test_every_known_exception_is_still_needed() -> None:
    """An exception that no longer happens is taken off the list."""
    gone = set(EXCEPTIONS) - set(arrows())

    assert gone == set()


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("idemflow.stores.postgres", "idemflow.stores.sql", True),
        ("idemflow.stores.postgres", "idemflow.stores.sql._async", False),
        ("idemflow.stores.sql._async", "idemflow.stores.sql._stats", True),
        ("idemflow.stores.sql._async", "idemflow._model", True),
        ("idemflow.integrations.flask", "idemflow._http", False),
        ("idemflow.integrations.flask", "idemflow._sync.edge", False),
        ("idemflow.integrations.flask", "idemflow.edge", True),
        ("idemflow.edge", "idemflow._http", True),
        ("idemflow._sync.driver", "idemflow._flow", True),
        ("idemflow.cli._purge", "idemflow.stores._stats", False),
        ("idemflow.cli._purge", "idemflow.cli._common", True),
    ],
)
def test_the_rule_itself(importer: str, imported: str, allowed: bool) -> None:
    """The checker tells the arrows the house allows from those it does not."""
    message = violation(tuple(importer.split(".")), tuple(imported.split(".")))

    assert (message is None) is allowed, message


def test_relative_imports_resolve_to_the_module_they_name() -> None:
    """``from ..sql import x`` in ``stores/postgres/__init__.py`` is ``idemflow.stores.sql``,
    and ``from ._async import x`` is the package's own ``idemflow.stores.postgres._async``."""
    found = imports(PACKAGE / "stores" / "postgres" / "__init__.py")

    assert ("idemflow", "stores", "sql") in found
    assert ("idemflow", "stores", "postgres", "_async") in found
    assert all(name[:4] != ("idemflow", "stores", "postgres", "sql") for name in found)


PROTOCOL = PACKAGE / "stores" / "protocol.py"


def contract_protocols() -> dict[str, set[str]]:
    """Each Protocol class of ``stores/protocol.py``, with the members it declares."""
    found = {}
    for node in ast.parse(PROTOCOL.read_text()).body:
        if isinstance(node, ast.ClassDef) and any(
            ast.unparse(base) in ("Protocol",) or ast.unparse(base).endswith("Store")
            for base in node.bases
        ):
            found[node.name] = {
                item.name
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return found


def test_the_store_contract_is_six_protocols_at_most() -> None:
    """Store and Transaction, sync and async, and the maintenance pair: capabilities are
    methods with defaults on these, never protocols of their own."""
    protocols = contract_protocols()

    assert set(protocols) == {
        "Store",
        "AsyncStore",
        "Transaction",
        "AsyncTransaction",
        "MaintainableStore",
        "AsyncMaintainableStore",
    }
    capabilities = {"claim_on_lent", "is_unavailable", "cover_stale_threshold", "cover_store_wait"}
    assert capabilities | {"stats"} <= protocols["Store"]
    assert {"execute_and_commit", "lend", "is_unavailable"} <= protocols["Transaction"]


def probes(source: str, protocols: set[str], members: set[str]) -> list[str]:
    """Where ``source`` asks whether a store or transaction has a capability instead of
    calling it: ``isinstance``/``issubclass`` against a contract protocol, ``hasattr`` or
    ``getattr`` of a contract member's name, ``runtime_checkable``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name | ast.alias) and "runtime_checkable" in ast.unparse(node):
            found.append(f"{getattr(node, 'lineno', '?')}: runtime_checkable")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        if name in ("isinstance", "issubclass") and len(args) == 2:
            kinds = {ast.unparse(n).rsplit(".", 1)[-1] for n in ast.walk(args[1])}
            if kinds & protocols:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if name in ("hasattr", "getattr") and len(args) >= 2:
            asked, attribute = ast.unparse(args[0]).lower(), args[1]
            of_the_contract = any(w in asked for w in ("store", "transaction", "lender", "adapter"))
            if (
                of_the_contract
                and isinstance(attribute, ast.Constant)
                and attribute.value in members
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_caller_probes_a_store_or_transaction_for_a_capability() -> None:
    protocols = contract_protocols()
    members = set().union(*protocols.values())
    found = {
        path.relative_to(PACKAGE).as_posix(): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := probes(path.read_text(), set(protocols), members))
    }

    assert found == {}


@pytest.mark.parametrize(
    "source",
    [
        "isinstance(store, AsyncStore)",
        "issubclass(type(t), protocol.Transaction)",
        "hasattr(store, 'claim_on_lent')",
        "getattr(transaction, 'lend', None)",
        "from typing import runtime_checkable",
    ],
)
def test_the_probe_check_catches_each_kind(source: str) -> None:
    protocols = contract_protocols()

    assert probes(source, set(protocols), set().union(*protocols.values())) != []


def module_files() -> dict[tuple[str, ...], Path]:
    """Every module of the library by its dotted name (a package by its ``__init__``)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def submodules_named(path: Path) -> set[tuple[str, ...]]:
    """What ``from package import name`` may import besides the package: ``package.name``
    (kept by :func:`import_graph` where it is a module: ``from ._async import edge``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package_of(path)[: len(package_of(path)) - node.level + 1] if node.level else ()
            module = base + tuple(node.module.split(".") if node.module else ())
            found |= {(*module, alias.name) for alias in node.names}
    return {name for name in found if name[0] == "idemflow"}


def import_graph(*, private_names: bool = True) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Which library modules each module imports, at any depth (in functions, under
    ``TYPE_CHECKING``): a name imported from a package counts as the module it names."""
    files = module_files()
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for name, path in files.items():
        targets = set()
        for imported in imports(path, private_names=private_names) | submodules_named(path):
            module = imported
            while module and module not in files:
                module = module[:-1]
            if module and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def circles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    found: list[list[str]] = []

    def visit(node: tuple[str, ...]) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(".".join(member))
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles() -> None:
    """No two modules of the library import each other, however indirectly (nor a package
    and a module under it: an ``__init__`` re-exports, it is not imported back)."""
    assert circles(import_graph()) == []


def test_the_circle_check_finds_one() -> None:
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {
        ("a",): {("b",)},
        ("b",): {("c",)},
        ("c",): {("a",)},
        ("d",): {("a",)},
    }

    assert circles(graph) == [["a", "b", "c"]]


#: Each layer imports only from the layers below it (the lowest first); a module's layer
#: is that of the longest prefix of its name listed here.
#: The transaction adapters rank with the stores: they speak the store contract on the
#: caller's connection and import nothing above it (``DjangoTransaction``, beside
#: ``DjangoStore``, sends its fused COMMIT through psycopg's).
LAYERS: list[tuple[str, ...]] = [
    ("idemflow._model", "idemflow._errors", "idemflow._process"),
    (
        "idemflow.stores",
        "idemflow.transactions",
        "idemflow._async.transactions",
        "idemflow._sync.transactions",
    ),
    ("idemflow._async", "idemflow._sync", "idemflow._http"),
    ("idemflow.integrations", "idemflow.consumers", "idemflow.audit", "idemflow.client"),
    ("idemflow.cli",),
]


def layer_of(name: tuple[str, ...]) -> int | None:
    dotted = ".".join(name)
    best: tuple[int, int] | None = None
    for rank, members in enumerate(LAYERS):
        for member in members:
            inside = dotted == member or dotted.startswith(member + ".")
            if inside and (best is None or len(member) > best[1]):
                best = (rank, len(member))
    return None if best is None else best[0]


def test_no_import_runs_up_a_layer() -> None:
    """The store contract, its backends and the transaction adapters sit below the
    drivers, which sit below the framework integrations, the client and the audit kit,
    and the CLI on top."""
    upward = sorted(
        f"{'.'.join(importer)} -> {'.'.join(imported)}"
        # A private name ranks as the module it is imported from, not as its package.
        for importer, targets in import_graph(private_names=False).items()
        for imported in targets
        if (below := layer_of(importer)) is not None
        and (above := layer_of(imported)) is not None
        and above > below
    )

    assert upward == []


def store_classes() -> list[str]:
    """Every class of the library that answers the store contract's ``claim`` (or, as
    ``DjangoStore`` over ``SQLStore``'s, its own ``claim_on_lent``)."""
    found = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                and item.name in ("claim", "claim_on_lent")
                for item in node.body
            ):
                found.append(f"{'.'.join(name)}.{node.name}")
    return found


def test_every_store_lives_under_stores() -> None:
    """What the driver calls a store (``DjangoStore`` included) sits below it, in
    ``idemflow.stores``: a claim never calls up into an integration."""
    stores = store_classes()

    assert "idemflow.stores.django.DjangoStore" in stores
    assert [name for name in stores if not name.startswith("idemflow.stores.")] == []
