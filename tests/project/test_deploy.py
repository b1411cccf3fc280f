"""
What ``deploy/`` ships is valid and speaks about metrics that exist: the alert
rules pass ``promtool`` (syntax and the unit tests in ``alerts_test.yml``), and
the Grafana dashboard is well-formed and queries only exported metric names.

``promtool`` comes from the Debian package ``prometheus``. Without it these
tests skip on a developer's machine and fail under ``CI=true``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from idemflow import Event, Idempotency, KeyReused, Policy
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.sqlite import SQLiteStore
from tests.conftest import IN_CI
from tests.ops_support import crash_after_claim, created, intent, metrics_endpoint, now

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "idemflow-dashboard.json"

# A metric name where it is used, not inside a recording rule's name
# ("endpoint:idemflow_replay_to_claim:ratio_rate15m").
_METRIC = re.compile(r"(?<![:\w])idemflow_[a-z_]+\b")
_RECORDED = re.compile(r"\b[a-z_]+:idemflow_[a-z_]+:[a-z0-9_]+\b")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed (apt-get install prometheus)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120, check=False)


def test_the_alert_rules_pass_promtool_check() -> None:
    """promtool check rules: valid PromQL and YAML, every rule accounted for."""
    done = run(promtool(), "check", "rules", str(ALERTS), cwd=ALERTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 8 rules found" in done.stdout


def test_the_alerts_fire_when_they_should_and_only_then() -> None:
    """promtool test rules: stuck claims, a rising ratio, outages, lost leases; and non-cases."""
    done = run(promtool(), "test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric family name a fully exercised PrometheusMetrics serves on /metrics."""
    metrics = PrometheusMetrics()
    store = SQLiteStore(tmp_path_factory.mktemp("deploy") / "keys.db")
    store.migrate()
    idem = Idempotency(store, Policy(), observer=metrics)
    idem.run(intent("k1"), created)
    idem.run(intent("k1"), created)
    with pytest.raises(KeyReused):
        idem.run(intent("k1", body=b"{}"), created)
    for event in Event:
        metrics(event, intent("any"), 0.001)
    crash_after_claim(store, "stuck", at=now() - 600)
    metrics.watch_stale_claims(store, 30)
    metrics.stale_reclaimed("released", "POST /payments")
    with metrics_endpoint(metrics.registry) as scrape:
        return {name for name, _ in scrape()}


def test_the_alert_rules_use_only_exported_metrics(exported: set[str]) -> None:
    """A renamed metric would silently disable an alert: every name must be served."""
    used = set(_METRIC.findall(ALERTS.read_text()))
    assert used
    assert used <= exported, used - exported


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def expressions(board: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_is_well_formed(exported: set[str]) -> None:
    """Valid JSON, unique panel ids, each panel on the chosen datasource with at least one query."""
    board = dashboard()
    assert board["uid"] == "idemflow"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "job", "endpoint"} <= variables
    for panel in board["panels"]:
        assert panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_the_dashboard_queries_only_exported_metrics(exported: set[str]) -> None:
    """Every metric a panel or a variable queries is one PrometheusMetrics serves."""
    exprs = expressions(dashboard())
    used = {name for expr in exprs for name in _METRIC.findall(expr)}
    assert {
        "idemflow_requests_total",
        "idemflow_claim_seconds_bucket",
        "idemflow_replay_seconds_bucket",
        "idemflow_stale_in_progress",
        "idemflow_stale_reclaimed_total",
    } <= used
    assert used <= exported, used - exported
    recorded = {name for expr in exprs for name in _RECORDED.findall(expr)}
    assert recorded <= set(_RECORDED.findall(ALERTS.read_text()))
