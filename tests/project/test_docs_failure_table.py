"""
The per-mode failure table in docs/crash-safety.md is checked against the tests it names.

Every row says, for each mode, what a failure leaves behind, and names in its
last column the tests that prove it, as pytest node ids. This collects those
tests with pytest itself (``--collect-only``, in a subprocess) and fails when a
row names a test that does not exist, when a mode's cell is empty, or when a
cell says nothing of what is left. Cells marked "not tested yet" are allowed
and listed in the output, so what is unproven stays visible.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "crash-safety.md"
HEADING = "## What each failure leaves behind, per mode"
MODES = ("transactional two-commit", "single-commit", "no transaction", "middleware")
NOT_TESTED = "not tested yet"
#: What a mode's cell must say is left behind (see the legend above the table).
LEFTOVERS = ("**nothing**", "**released**", "**claimed**", "**settled**", "the sweeper's", "n/a")
NODE_ID = re.compile(r"`(tests/[^`\s]+\.py::[^`\s]+)`")


@dataclass(frozen=True)
class Row:
    failure: str
    cells: dict[str, str]  # mode -> cell
    tests: tuple[str, ...]  # node ids, as written
    tests_cell: str


def table_lines(text: str) -> list[str]:
    """The lines of the first Markdown table after the heading."""
    _, found, after = text.partition(HEADING + "\n")
    assert found, f"{DOC.name} has no section {HEADING!r}"
    lines: list[str] = []
    for line in after.splitlines():
        if line.startswith("## "):
            break
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break  # the table ended
    assert lines, f"no table under {HEADING!r}"
    return lines


def cells_of(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse(text: str) -> list[Row]:
    """The table's rows; asserts its header names the modes, in order, then the tests."""
    header, separator, *body = table_lines(text)
    columns = [c.lower() for c in cells_of(header)]
    assert len(columns) == len(MODES) + 2, f"header must be failure, {MODES}, tests: {columns}"
    for column, mode in zip(columns[1:-1], MODES, strict=True):
        assert column.startswith(mode), f"column {column!r} should be the {mode!r} mode"
    assert columns[-1] == "tests", columns
    assert set(separator.replace("|", "").split()) <= {"---", ":---", "---:", ":---:"}
    rows = []
    for line in body:
        cells = cells_of(line)
        assert len(cells) == len(columns), f"a row needs {len(columns)} cells: {line[:80]}"
        failure, *modes, tests = cells
        rows.append(
            Row(failure, dict(zip(MODES, modes, strict=True)), tuple(NODE_ID.findall(tests)), tests)
        )
    return rows


def collected(node_ids: set[str]) -> set[str]:
    """Every test pytest collects from the files these node ids name."""
    files = sorted({node_id.split("::", 1)[0] for node_id in node_ids})
    missing_files = [f for f in files if not (ROOT / f).is_file()]
    assert not missing_files, f"the table names files that do not exist: {missing_files}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    found = {line.strip() for line in result.stdout.splitlines() if "::" in line}
    assert found, f"pytest collected nothing from {files}:\n{result.stdout}\n{result.stderr}"
    return found


def is_collected(node_id: str, found: set[str]) -> bool:
    """The exact test, or a test function whose parametrized cases were collected."""
    return node_id in found or any(f.startswith(node_id + "[") for f in found)


def problems(rows: list[Row], found: set[str]) -> list[str]:
    """Everything wrong with the table, one message each."""
    wrong = []
    for row in rows:
        if not row.failure:
            wrong.append("a row names no failure point")
        for mode, cell in row.cells.items():
            if not cell:
                wrong.append(f"{row.failure!r}: the {mode!r} cell is empty")
            elif not any(word in cell for word in LEFTOVERS) and NOT_TESTED not in cell.lower():
                wrong.append(f"{row.failure!r}: the {mode!r} cell says nothing of what is left")
        if not row.tests and NOT_TESTED not in row.tests_cell.lower():
            wrong.append(f"{row.failure!r}: names no test (write one, or say {NOT_TESTED!r})")
        wrong += [
            f"{row.failure!r}: {node_id} is not a collected test"
            for node_id in row.tests
            if not is_collected(node_id, found)
        ]
    return wrong


def untested(rows: list[Row]) -> list[str]:
    """The cells that say honestly that nothing proves them yet."""
    return [
        f"{row.failure} / {mode}"
        for row in rows
        for mode, cell in {**row.cells, "tests": row.tests_cell}.items()
        if NOT_TESTED in cell.lower()
    ]


def test_every_row_of_the_failure_table_names_tests_that_exist(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = parse(DOC.read_text(encoding="utf-8"))
    found = collected({node_id for row in rows for node_id in row.tests})

    assert len(rows) >= 12, "the table lost rows"
    assert problems(rows, found) == []
    with capsys.disabled():  # always shown: what the table admits is unproven
        for cell in untested(rows):
            print(f"\n{DOC.name}: {NOT_TESTED}: {cell}")


REAL = "tests/core/test_flow.py::test_handler_exception_releases_then_reraises_the_same_object"
GHOST = "tests/core/test_flow.py::test_that_never_existed"
FAKE_TABLE = "\n".join(
    [
        HEADING,
        "",
        "| Failure point | transactional two-commit | single-commit | no transaction "
        "| middleware | Tests |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| a real row | **released** | **nothing** | **released** | **released** | `{REAL}` |",
        f"| a row naming a ghost | **released** | **nothing** | **released** | {NOT_TESTED} "
        f"| `{GHOST}` |",
        f"| a row with a hole | **released** |  | whatever | **released** | {NOT_TESTED} |",
        "",
    ]
)


def test_the_check_fails_on_a_ghost_test_an_empty_cell_and_a_vague_one() -> None:
    """The checker itself can fail: a row naming a test that does not exist, an empty cell
    and a cell that says nothing of what is left are all reported; a "not tested yet"
    cell is allowed and listed."""
    rows = parse(FAKE_TABLE)
    found = collected({node_id for row in rows for node_id in row.tests})

    assert problems(rows, found) == [
        f"'a row naming a ghost': {GHOST} is not a collected test",
        "'a row with a hole': the 'single-commit' cell is empty",
        "'a row with a hole': the 'no transaction' cell says nothing of what is left",
    ]
    assert untested(rows) == ["a row naming a ghost / middleware", "a row with a hole / tests"]
