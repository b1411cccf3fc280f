"""The scaling benchmark runs, end to end, at tiny sizes (so docs/scaling.md's command cannot rot).

No figure is asserted (timing belongs to bench/): what is checked is that
every part prints its tables from real PostgreSQL and SQLite, that the
time-partitioned key table is refused by PostgreSQL itself, and that the run
leaves none of its tables behind.
"""

from __future__ import annotations

import uuid

import pytest
from bench import bench_scaling

from tests.conftest import POSTGRES_URL
from tests.factories import psycopg_or_skip

# Slices of 0.3 s: each must outlast one operation on a loaded machine (the harness divides
# by every slice's count), and the run still takes only seconds.
TINY = [
    "--backends", "postgres,sqlite",
    "--postgres-sizes", "100,300", "--sqlite-sizes", "100,300",
    "--seconds", "0.3", "--slices", "1", "--warmup", "0.02", "--callers", "2",
    "--stale", "10", "--sweep-rounds", "1", "--expired", "150", "--purge-batch", "100",
    "--hot-size", "100", "--partition-size", "100", "--partitions", "2", "--stores-size", "100",
]  # fmt: skip


@pytest.mark.postgres
def test_every_part_runs_at_tiny_sizes_and_drops_its_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    psycopg = psycopg_or_skip()
    run_id = f"t{uuid.uuid4().hex[:8]}"
    bench_scaling.main([*TINY, "--run-id", run_id])
    out = capsys.readouterr().out

    for backend in ("postgres", "sqlite"):
        assert f"| {backend}: 300 ÷ 100 | claim+complete | 2 |" in out
        assert f"| {backend}: 300 ÷ 100 | replay | 2 |" in out
        assert f"| {backend}: one principal, time-ordered keys ÷ 1,000 principals" in out
    assert "| 300 | 10 |" in out  # the sweeper's ms per record, per table
    assert "| 300 | 150 | 1 |" in out  # purged 150 in one full batch of 100 (and the rest)
    assert "| postgres: 100, 2 hash partitions ÷ 100 | claim+complete |" in out
    assert "1 partition scanned" in out
    assert (
        "FeatureNotSupported: unique constraint on partitioned table must include all "
        "partitioning columns" in out
    )
    assert "no unique or exclusion constraint matching the ON CONFLICT" in out
    assert "2 rows for one (principal, key): both claims won" in out
    assert "| stores: sqlite ÷ postgres | claim+complete |" in out

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        left = conn.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE %s", (f"scale\\_{run_id}%",)
        ).fetchall()
    assert left == []
