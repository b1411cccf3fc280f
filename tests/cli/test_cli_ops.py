"""
``idemflow inspect`` and ``idemflow stats`` against real SQLite files and the real
PostgreSQL server, with records written by the driver itself; and their error
paths, which are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import Attempt, Idempotency, Response, State
from idemflow.cli import main
from idemflow.logs import key_digest
from idemflow.testing import FrozenClock
from tests.ops_support import (
    DAY,
    crash_after_claim,
    intent,
    now,
    open_store,
    settle,
    store_url,
)

KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
SCRIPT = Path(sys.executable).with_name("idemflow")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "idemflow"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path, table_name: str) -> Iterator[Any]:
    with open_store(kind, tmp_path, table_name) as store:
        yield store


@pytest.fixture
def url(kind: str, tmp_path: Path) -> str:
    return store_url(kind, tmp_path)


@pytest.fixture(autouse=True)
def no_url_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEMFLOW_DATABASE_URL", raising=False)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, _ = cli(capsys, *argv, "--json")
    return code, json.loads(out)


def one_line_error(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"idemflow {command}: ")
    assert "Traceback" not in err
    return lines[0]


# --- inspect --------------------------------------------------------------------


def test_inspect_shows_a_completed_record(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """State, digests, shortened lease, ISO times, status and body preview, correlation id."""
    at = now() - 60
    settle(store, "k1", at=at, correlation_id="req-42")
    code, shown = cli_json(
        capsys, "inspect", url, "--table", table_name, "--principal", "alice", "k1"
    )
    assert code == 0
    record = store.get("alice", "k1")
    assert shown["found"] is True
    assert shown["state"] == "completed"
    assert shown["endpoint"] == "POST /payments"
    assert shown["fingerprint"] == record.fingerprint
    assert shown["key_digest"] == key_digest("alice", "k1")
    assert shown["lease_token"] == record.lease_token[:8] + "…"
    assert shown["attempt"] == 1
    assert shown["correlation_id"] == "req-42"
    assert shown["created_at"].endswith("Z")
    assert abs(_epoch(shown["created_at"]) - at) < 0.002
    assert abs(_epoch(shown["expires_at"]) - (at + DAY)) < 0.002
    assert shown["expired"] is False
    assert 59 < shown["age_seconds"] < 120
    assert shown["response"]["status"] == 201
    assert shown["response"]["headers"] == [["content-type", "application/json"]]
    assert json.loads(shown["response"]["body_preview"]) == {"id": 1, "status": "succeeded"}


def test_inspect_in_a_table_for_people(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Rich table shows every field; body text is shown as text, never as markup."""
    Idempotency(store).run(
        intent("k1"), lambda attempt: Response.json(201, {"note": "[bold]x[/bold]"})
    )
    code, out, err = cli(
        capsys, "inspect", url, "--table", table_name, "--principal", "alice", "k1"
    )
    assert (code, err) == (0, "")
    for label in ("state", "fingerprint", "lease token", "created at", "body preview"):
        assert label in out
    assert "completed" in out
    assert "[bold]x[/bold]" in out


def test_inspect_shows_an_unsettled_retry_with_its_recovery_point(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A released attempt that checkpointed, then taken over: attempt 2, its recovery point."""

    def charged_then_failed(attempt: Attempt) -> Response:
        attempt.checkpoint("charged")
        return Response.json(503, {"title": "provider down"})

    Idempotency(store).run(intent("k1"), charged_then_failed)
    crash_after_claim(store, "k1", at=now())
    code, shown = cli_json(
        capsys, "inspect", url, "--table", table_name, "--principal", "alice", "k1"
    )
    assert code == 0
    assert shown["state"] == "in_progress"
    assert shown["attempt"] == 2
    assert shown["recovery_point"] == "charged"
    assert shown["response"] is None


def test_inspect_escapes_a_binary_body(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes that are not UTF-8 are shown escaped, and only the first 200 of them."""
    body = b"\x00\xff" + b"A" * 500
    Idempotency(store).run(intent("k1"), lambda attempt: Response(200, body))
    _, shown = cli_json(capsys, "inspect", url, "--table", table_name, "--principal", "alice", "k1")
    response = shown["response"]
    assert response["body_binary"] is True
    assert response["body_bytes"] == 502
    assert response["body_preview"] == "\\x00\\xff" + "A" * 198 + "…"


def test_inspect_of_a_missing_key_exits_non_zero(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No record: exit 3 and one line, whatever principal owns the same key."""
    settle(store, "k1", at=now())
    code, out, err = cli(capsys, "inspect", url, "--table", table_name, "--principal", "bob", "k1")
    assert code == 3
    assert out == ""
    assert "no record for principal 'bob' and key 'k1'" in one_line_error(err, "inspect")
    code, out, _ = cli(
        capsys, "inspect", url, "--table", table_name, "--principal", "bob", "k1", "--json"
    )
    assert code == 3
    assert json.loads(out)["found"] is False


def test_an_expired_record_is_absent_for_the_next_claim(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past retention, unpurged: inspect says expired, and a new request with another body runs."""
    settle(store, "k1", at=now() - 2 * DAY)
    argv = ["--table", table_name]
    _, shown = cli_json(capsys, "inspect", url, *argv, "--principal", "alice", "k1")
    assert shown["expired"] is True
    _, stats = cli_json(capsys, "stats", url, *argv)
    assert stats["expired_unpurged"] == 1

    # A different body under the same key would be a 422 if the old record counted.
    outcome = Idempotency(store).run(intent("k1", body=b'{"amount":5}'), _created_again)
    assert not outcome.replayed
    _, shown = cli_json(capsys, "inspect", url, *argv, "--principal", "alice", "k1")
    assert (shown["expired"], shown["attempt"], shown["state"]) == (False, 1, "completed")
    assert shown["fingerprint"] == intent("k1", body=b'{"amount":5}').fingerprint
    _, stats = cli_json(capsys, "stats", url, *argv)
    assert stats["expired_unpurged"] == 0


def _created_again(attempt: Attempt) -> Response:
    return Response.json(201, {"id": 2})


# --- stats ----------------------------------------------------------------------


def seed_table(store: Any) -> float:
    """A table with something in every interesting state; returns "now"."""
    t = now()
    settle(store, "paid-1", at=t - 30)
    settle(store, "paid-2", at=t - 20, principal="bob")
    settle(store, "refund-1", at=t - 10, endpoint="POST /refunds")
    Idempotency(store, clock=FrozenClock(t)).run(
        intent("declined", endpoint="POST /refunds"), lambda a: Response.json(402, {})
    )
    settle(store, "old-1", at=t - 3 * DAY)
    settle(store, "old-2", at=t - 2 * DAY, endpoint="POST /refunds")
    crash_after_claim(store, "crashed", at=t - 600)
    crash_after_claim(store, "slow", at=t - 12)
    crash_after_claim(store, "swept", at=t - 900, endpoint="POST /refunds")
    store.sweep(State.IN_PROGRESS, t - 800, t, t + DAY, 10)  # marks "swept" only
    return t


def test_stats_counts_by_state_and_endpoint_and_finds_what_is_stuck(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counts, the oldest in_progress, claims past the timeout and the threshold, expired."""
    t = seed_table(store)
    code, stats = cli_json(capsys, "stats", url, "--table", table_name)
    assert code == 0
    assert stats["total"] == 9
    assert stats["by_state"] == {
        "in_progress": 2,
        "completed": 5,
        "failed_permanent": 1,
        "released": 0,
        "stale": 1,
    }
    assert {
        (row["state"], row["endpoint"]): row["count"] for row in stats["by_state_and_endpoint"]
    } == {
        ("completed", "POST /payments"): 3,
        ("completed", "POST /refunds"): 2,
        ("failed_permanent", "POST /refunds"): 1,
        ("in_progress", "POST /payments"): 2,
        ("stale", "POST /refunds"): 1,
    }
    oldest = stats["oldest_in_progress"]
    assert (oldest["principal"], oldest["key"]) == ("alice", "crashed")
    assert oldest["key_digest"] == key_digest("alice", "crashed")
    assert 599 < oldest["idle_seconds"] < 700
    assert stats["request_timeout_seconds"] == 30
    assert stats["stale_after_seconds"] == 70
    assert stats["in_progress_past_request_timeout"] == 1
    assert stats["in_progress_past_stale_threshold"] == 1
    assert stats["expired_unpurged"] == 2
    assert abs(_epoch(stats["now"]) - t) < 60


def test_stats_derives_the_thresholds_from_the_request_timeout(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 3 s timeout: the 12 s-old claim is past it; the threshold is 2 × 3 + 10 = 16 s."""
    seed_table(store)
    _, stats = cli_json(capsys, "stats", url, "--table", table_name, "--request-timeout", "3")
    assert stats["stale_after_seconds"] == 16
    assert stats["in_progress_past_request_timeout"] == 2
    assert stats["in_progress_past_stale_threshold"] == 1


def test_stats_in_tables_for_people(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One row per endpoint plus the totals, then what needs attention."""
    seed_table(store)
    code, out, err = cli(capsys, "stats", url, "--table", table_name)
    assert (code, err) == (0, "")
    assert "records by state" in out
    assert "POST /payments" in out
    assert "POST /refunds" in out
    assert "all endpoints" in out
    assert "oldest in_progress" in out
    assert "'crashed'" in out
    assert "expired, not purged yet" in out


def test_stats_without_rich_prints_plain_text(
    tmp_path: Path, table_name: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Rich is optional: without it the same figures come as aligned plain text."""
    with open_store("sqlite", tmp_path, table_name) as store:
        seed_table(store)
    for module in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, module, None)
    code, out, _ = cli(capsys, "stats", store_url("sqlite", tmp_path), "--table", table_name)
    assert code == 0
    assert "┃" not in out
    assert "│" not in out
    payments = next(line for line in out.splitlines() if "POST /payments" in line)
    assert payments.split()[2:] == ["2", "3", "0", "0", "0", "5"]


def test_stats_of_an_empty_table(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing stored: zeros, and no oldest claim."""
    _, stats = cli_json(capsys, "stats", url, "--table", table_name)
    assert stats["total"] == 0
    assert stats["oldest_in_progress"] is None
    assert set(stats["by_state"].values()) == {0}


# --- errors ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "stats", "purge"])
def test_a_missing_table_says_to_migrate(
    command: str,
    store: Any,
    url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A table that does not exist is one clear line naming it."""
    extra = ["--principal", "alice", "k1"] if command == "inspect" else []
    code, out, err = cli(capsys, command, url, "--table", "no_such_table", *extra)
    assert code == 1
    assert out == ""
    line = one_line_error(err, command)
    assert line.endswith(
        "table no_such_table does not exist (check --table): "
        "run idemflow migrate --table no_such_table"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "postgresql://postgres@127.0.0.1:1/test",
            "cannot reach postgresql://postgres@127.0.0.1:1/test: connection failed",
        ),
        ("bogus://somewhere/db", "unsupported database URL 'bogus://somewhere/db'"),
        ("sqlite://host/db.sqlite", "sqlite URLs take a path, not a host"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "stats", "purge"])
def test_an_unusable_url_is_one_line(
    command: str, url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unreachable server, unknown scheme, malformed URL: one line each, exit 1."""
    extra = ["--principal", "alice", "k1"] if command == "inspect" else []
    code, out, err = cli(capsys, command, url, *extra)
    assert code == 1
    assert out == ""
    assert message in one_line_error(err, command)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        pytest.param(
            "postgresql://postgres@127.0.0.1:5432/idemflow_no_such_db",
            'database "idemflow_no_such_db" does not exist',
            marks=pytest.mark.postgres,
        ),
        pytest.param(
            "mysql://root@127.0.0.1:3306/idemflow_no_such_db",
            "Unknown database 'idemflow_no_such_db'",
            marks=pytest.mark.mysql,
        ),
    ],
)
def test_an_unknown_database_is_one_line(
    url: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """PostgreSQL and MySQL alike: the server's reason after the redacted URL, no driver class."""
    code, out, err = cli(capsys, "stats", url)
    assert (code, out) == (1, "")
    line = one_line_error(err, "stats")
    assert line.startswith(f"idemflow stats: cannot reach {url}: ")
    assert says in line
    assert "Error" not in err


def test_a_missing_sqlite_file_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Looking at a mistyped path must not leave an empty database behind."""
    missing = tmp_path / "typo.db"
    code, _, err = cli(capsys, "stats", f"sqlite:///{missing}")
    assert code == 1
    assert "does not exist" in one_line_error(err, "stats")
    assert not missing.exists()


def test_no_url_and_no_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a URL the error names the variable to set."""
    code, _, err = cli(capsys, "stats")
    assert code == 1
    assert "IDEMFLOW_DATABASE_URL is not set" in one_line_error(err, "stats")


def test_an_unsafe_stale_threshold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stats applies the Policy's own rule: the threshold must exceed 2 × timeout + 10 s."""
    code, _, err = cli(
        capsys,
        "stats",
        f"sqlite:///{tmp_path}/k.db",
        "--request-timeout",
        "30",
        "--stale-after",
        "31",
    )
    assert code == 1
    assert "stale_after=31s is unsafe" in one_line_error(err, "stats")


def test_the_installed_command_reads_the_environment_variable(
    tmp_path: Path, table_name: str
) -> None:
    """As an operator runs it: a process of its own, the URL from IDEMFLOW_DATABASE_URL."""
    with open_store("sqlite", tmp_path, table_name) as store:
        settle(store, "k1", at=now())
    env = {**os.environ, "IDEMFLOW_DATABASE_URL": store_url("sqlite", tmp_path)}
    done = subprocess.run(
        [*COMMAND, "inspect", "--table", table_name, "--principal", "alice", "k1", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["state"] == "completed"

    done = subprocess.run(
        [*COMMAND, "stats", "--table", "absent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr == (
        "idemflow stats: table absent does not exist (check --table): "
        "run idemflow migrate --table absent\n"
    )


@pytest.mark.parametrize("command", ["inspect", "stats", "purge"])
def test_help_describes_every_option(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--help names the URL forms, the environment variable and each option."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for word in ("DATABASE_URL", "IDEMFLOW_DATABASE_URL", "sqlite:///", "postgresql://", "--table"):
        assert word in text
    assert "--json" in text


def _epoch(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
