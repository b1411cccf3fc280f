"""
The storm through a broken network between the demo and its store (issue 15).

This machine's kernel has no ``netem`` (``tc qdisc add … netem`` answers
"Specified qdisc kind is unknown"; there is no sch_netem module to load), so
network namespaces could carry the traffic but not break it. The faults come
from the storm's loopback relay instead (:mod:`idemflow_demo.storm.network`):
partitions at random moments (a statement sent just before one ran and its
reply is lost: a claim, a checkpoint or a COMMIT), 5 ms ± 3 ms on every chunk
and 2 % of chunks stalled one retransmission timeout. Same verdict as under
SIGKILLs: no duplicate effect, no key with two answers, every key settled
within the stale threshold + two sweeps after the last heal, and only 503 (or
409 for a claim left behind), each with ``Retry-After``, while the store is
out of reach.

Three stores: PostgreSQL (keys and payments in one transaction), MariaDB
(the same, on asyncmy) and Redis (keys in Redis, payments in SQLite: no
shared transaction, so a completion lost to the partition leaves the key
claimed until the sweeper's reconciler settles it from the rows).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.demo_stores import mysql_url, redis_url
from tests.guarantees.test_storm import storm
from tests.http.conftest import pg_url

__all__ = ["mysql_url", "pg_url", "redis_url"]

#: The 1 s request timeout: a claim left behind is stale after 12 s, not 14 s
#: (settling may still take the 26 s it had at 2 s). The window stays: with more
#: keys a second (15 s → 10 s) keys went unresolved on a loaded machine.
NETWORK_STORM = [
    *("--keys", "100", "--retries", "3", "--duration", "15", "--kill-every", "0"),
    *("--request-timeout", "1", "--settle-for", "26"),
    *("--partition-every", "3", "--partition-for", "1.5"),
    *("--network-delay-ms", "5", "--network-jitter-ms", "3", "--network-stall-rate", "0.02"),
]

#: The same faults, smaller and quicker (60 keys over 8 s, a 1 s request
#: timeout: a claim left behind is stale after 12 s), for the other stores.
SHORT_NETWORK_STORM = [
    *("--keys", "60", "--retries", "3", "--duration", "8", "--kill-every", "0"),
    *("--request-timeout", "1", "--partition-every", "2", "--partition-for", "1"),
    *("--network-delay-ms", "5", "--network-jitter-ms", "3", "--network-stall-rate", "0.02"),
]


def assert_exactly_once_through_partitions(verdict: dict[str, Any], keys: int) -> None:
    assert verdict["violations"] == [], verdict["details"]
    assert verdict["partitions"] >= 2
    assert verdict["connections_reset"] > 0  # statements lost mid-flight, replies included
    assert verdict["duplicate_charges"] == verdict["duplicate_payments"] == 0
    assert verdict["unresolved"] == verdict["different_answers"] == 0
    assert verdict["payments"] == verdict["charges"] == keys
    # Out of reach, the store costs 503s (and 409s for claims left behind), nothing else.
    assert set(verdict["responses"]) <= {"201", "402", "409", "503"}, verdict["responses"]
    assert int(verdict["responses"].get("503", 0)) > 0
    assert verdict["without_retry_after"] == 0


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_the_storm_is_exactly_once_through_a_partitioned_network(pg_url: str) -> None:
    verdict = storm(*NETWORK_STORM, "--database", pg_url)
    assert_exactly_once_through_partitions(verdict, 100)


@pytest.mark.slow
@pytest.mark.mysql
@pytest.mark.timeout(240)
def test_the_storm_is_exactly_once_through_a_partitioned_network_on_mariadb(
    mysql_url: str,
) -> None:
    """Keys and payments in MariaDB, two-commit claims, on asyncmy: the same verdict."""
    verdict = storm(*SHORT_NETWORK_STORM, "--database", mysql_url)
    assert_exactly_once_through_partitions(verdict, 60)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_the_storm_is_exactly_once_through_a_partitioned_network_on_redis(
    redis_url: str,
) -> None:
    """Keys in Redis, payments in SQLite, no shared transaction: the same verdict."""
    verdict = storm(*SHORT_NETWORK_STORM, "--database", redis_url)
    assert_exactly_once_through_partitions(verdict, 60)
