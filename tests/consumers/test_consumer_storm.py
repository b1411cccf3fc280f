"""
``idemflow consumer-storm``: its verdict catches a duplicate effect and every kind of
unresolved message, and the Redis Streams consumer passes it with consumers SIGKILLed,
producers publishing twice and the broker killed and restarted mid-run.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

from idemflow.cli import main
from tests.conftest import unreachable

pytest.importorskip("redis")
from idemflow_demo.consumer_storm.run import judge


def test_the_verdict_counts_every_extra_effect_and_every_message_left() -> None:
    """``a``: an entry never acked; ``b``: three effects; ``c``: none; ``d``: its claim
    not completed."""
    effects = Counter({"a": 1, "b": 3, "d": 1})

    verdict = judge(["a", "b", "c", "d"], effects, {"a", "b", "c"}, Counter({"a": 1}))

    assert verdict.duplicate_effects == 2
    assert (verdict.without_effect, verdict.claims_not_completed) == (1, 1)
    assert (verdict.entries_not_acked, verdict.unresolved) == (1, 3)
    assert not verdict.ok
    assert verdict.lines()[-1] == "verdict: VIOLATED: 2 duplicate effects, 3 unresolved messages"


def test_each_message_once_completed_and_acked_is_exactly_once() -> None:
    verdict = judge(["a", "b"], Counter({"a": 1, "b": 1}), {"a", "b"}, Counter())

    assert verdict.ok
    assert (verdict.duplicate_effects, verdict.unresolved) == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_consumer_storm_is_exactly_once_under_kills_and_a_broker_restart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if shutil.which("redis-server") is None:
        unreachable("redis-server", FileNotFoundError("redis-server is not on the PATH"))
    argv = ["--keys", "80", "--duration", "5", "--kill-every", "0.5", "--json"]

    code = main(["consumer-storm", *argv])

    verdict = json.loads(capsys.readouterr().out)
    assert code == 0, verdict
    assert (verdict["duplicate_effects"], verdict["unresolved"]) == (0, 0)
    assert verdict["effects"] == verdict["messages"] == 80
    assert verdict["publishes"] > 80  # messages published more than once
    assert verdict["kills"] >= 1  # consumers at work (a loaded machine starts them slowly)
    assert verdict["broker_restarts"] == 1
