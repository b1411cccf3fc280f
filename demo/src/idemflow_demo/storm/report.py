"""The verdict as a table (Rich if installed, plain text otherwise) or as JSON."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from .verdict import Verdict

__all__ = ["render", "render_json", "rows"]

#: Rows whose value must be 0: the guarantees.
MUST_BE_ZERO = (
    ("DUPLICATE CHARGES", "duplicate_charges"),
    ("duplicate payments", "duplicate_payments"),
    ("keys with two different answers", "different_answers"),
    ("keys never resolved", "unresolved"),
    ("answers disagreeing with the ledger", "inconsistent"),
    ("wrong answers (4xx but 402/409)", "wrong_answers"),
    ("409 or 503 without Retry-After", "without_retry_after"),
)
PASS, FAIL = "ok", "VIOLATED"


def _number(value: float) -> str:
    return f"{value:g}"


def rows(verdict: Verdict) -> list[tuple[str, str, str]]:
    """``(what, value, check)``; check is empty for figures, PASS/FAIL for guarantees."""
    by_status = " · ".join(f"{status}: {n}" for status, n in verdict.responses.items())
    stale = verdict.stale_reclaimed
    at_least = "≥ " if verdict.metrics_missed else ""  # counters of an unread incarnation
    figures = [
        ("keys", f"{verdict.keys} × {verdict.clients_per_key} concurrent clients"),
        ("requests sent", str(verdict.requests)),
        ("responses by status", by_status or "none"),
        ("connection errors (server down)", str(verdict.connection_errors)),
        ("replays (Idempotent-Replayed: true)", str(verdict.replays)),
        ("409 in progress", str(verdict.conflicts)),
        ("releases (transient failure)", at_least + _number(verdict.releases)),
        (
            "stale claims reclaimed",
            f"{at_least}{_number(sum(stale.values()))} (completed {_number(stale['completed'])}, "
            f"released {_number(stale['released'])}, unknown {_number(stale['unknown'])})",
        ),
        ("lease lost (late completion fenced)", at_least + _number(verdict.lease_lost)),
        ("payments created", str(verdict.payments)),
        ("provider charges made", str(verdict.charges)),
        ("kills (SIGKILL + restart)", str(verdict.kills)),
    ]
    if verdict.server_errors:  # not exactly-once broken, but worth a look in the log
        figures.append(("server errors (5xx but 503; retried)", str(verdict.server_errors)))
    checks = [
        (label, str(getattr(verdict, name)), FAIL if getattr(verdict, name) else PASS)
        for label, name in MUST_BE_ZERO
    ]
    if verdict.truncated:
        checks.append(("lists cut short (cannot verify)", ", ".join(verdict.truncated), FAIL))
    return [(label, value, "") for label, value in figures] + checks


def summary(verdict: Verdict) -> str:
    if verdict.ok:
        return (
            f"verdict: EXACTLY ONCE. {verdict.keys} keys, {verdict.requests} requests, "
            f"{verdict.kills} kills: no duplicate charge, every key answered one way "
            f"({verdict.elapsed:g} s)."
        )
    return f"verdict: VIOLATED: {', '.join(verdict.violations)} ({verdict.elapsed:g} s)."


def render(verdict: Verdict, title: str, out: TextIO | None = None) -> None:
    """The table and a one-line verdict; plain text when Rich is missing."""
    stream = out or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        _plain(verdict, title, stream)
        return
    console = Console(file=stream, width=None if stream.isatty() else 100, highlight=False)
    table = Table(title=title, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("must be 0", justify="center")
    for label, value, check in rows(verdict):
        style = "bold red" if check == FAIL else "green" if check == PASS else ""
        table.add_row(label, Text(value, style=style), Text(check, style=style))
    console.print(table)
    console.print(Text(summary(verdict), style="bold green" if verdict.ok else "bold red"))
    _print_details(verdict, stream)


def _plain(verdict: Verdict, title: str, stream: TextIO) -> None:
    table = rows(verdict)
    width = max(len(label) for label, _, _ in table)
    print(title, file=stream)
    for label, value, check in table:
        print(f"  {label.ljust(width)}  {value}  {check}".rstrip(), file=stream)
    print(summary(verdict), file=stream)
    _print_details(verdict, stream)


def _print_details(verdict: Verdict, stream: TextIO) -> None:
    for name, keys in verdict.details.items():
        shown = ", ".join(keys[:10]) + (f", … ({len(keys)} in all)" if len(keys) > 10 else "")
        print(f"  {name}: {shown}", file=stream)


def render_json(verdict: Verdict, extra: dict[str, object], out: TextIO | None = None) -> None:
    print(json.dumps({**extra, **verdict.as_json()}, indent=2), file=out or sys.stdout)
