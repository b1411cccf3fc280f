"""
MySQL 8 and MariaDB (≥ 10.6): key records in InnoDB, on PyMySQL (:class:`MySQLStore`)
or, from asyncio, on asyncmy (:class:`AsyncMySQLStore`, the same statements and rules).

Neither server has ``UPDATE … RETURNING`` (MySQL 8 has no ``INSERT …
RETURNING`` either), and ``INSERT IGNORE`` is out: it turns every error
(truncation, bad values, a NULL in a NOT NULL column) into a warning, so
"0 rows" would no longer mean "duplicate". The claim is therefore:

1. a plain ``INSERT``: it succeeds (the key is ours, and we know every
   column of the row: one round trip), or fails with error 1062;
2. on 1062, the current row is read (``packed_read``: the values in one JSON
   array, the headers and the body beside it; PyMySQL parses a packet per
   result column, and 17 of them were a third of a replay's client CPU).
   Held, or settled: that is the answer (a replay is these two round trips).
   Past its retention, or released by this same request: a takeover is
   attempted with one
   ``INSERT … ON DUPLICATE KEY UPDATE`` whose every assignment is guarded by
   that same condition on the *current* row, writing a fresh lease token only
   if it still holds; reading the row back by that token tells us whether
   we won.

Each decision is one atomic statement; the reads only report or route it.
``INSERT … ON DUPLICATE KEY UPDATE`` for every claim was measured and
rejected: its long guarded statement costs the server about twice a plain
insert, and halved fresh-claim throughput at 16 callers (``python -m
bench.bench_stores``, ``docs/stores.md``). So were the two ways of making a
replay one round trip (a stored procedure, ``… ON DUPLICATE KEY UPDATE id = id
RETURNING``): each costs every first claim 9–42 % of its throughput
(``python -m bench.bench_mysql_claim_shapes``). Its affected-row count (1 new, 2
updated, 0 untouched; *1* untouched under ``CLIENT_FOUND_ROWS``) is never
trusted alone: ownership is read off the lease token, so the store is correct
with the flag on or off.

Keys, principals and fingerprints are ``VARBINARY``: MySQL's ``*_bin``
collations (``ascii_bin``, ``utf8mb4_bin``) are PAD SPACE, so ``'k'`` and
``'k '`` would collide in the unique index; binary strings compare byte for
byte, so neither case nor trailing spaces can merge two keys.
"""

from __future__ import annotations

from ..._deprecation import moved
from ._async import AsyncMySQLStore
from ._binding import closed_by_server
from ._errors import (
    UNAVAILABLE_CODES,
    error_code,
    is_conflict,
    is_contention,
    is_unavailable,
    rolled_back,
)
from ._statements import (
    DEFAULT_LOCK_WAIT_TIMEOUT,
    SERVER_NOW_MS,
    MySQLStatements,
    mysql_dialect,
    mysql_statements,
)
from ._sync import MySQLStore
from ._url import connect_kwargs

__all__ = [
    "DEFAULT_LOCK_WAIT_TIMEOUT",
    "SERVER_NOW_MS",
    "UNAVAILABLE_CODES",
    "AsyncMySQLStore",
    "MySQLStatements",
    "MySQLStore",
    "closed_by_server",
    "connect_kwargs",
    "error_code",
    "is_conflict",
    "is_contention",
    "is_unavailable",
    "mysql_dialect",
    "mysql_statements",
    "rolled_back",
]

#: The adapters live with every other in :mod:`idemflow.transactions` (a store never
#: imports the layer above it); the store's own statement helpers are private (issue 32:
#: a public API chosen on purpose). Both importable from here, with a DeprecationWarning,
#: until 0.3.
__getattr__ = moved(
    __name__,
    {
        **{
            name: f"idemflow.transactions:{name}"
            for name in ("AsyncmyTransaction", "PyMySQLTransaction")
        },
        **{
            name: f"idemflow.stores.mysql._statements:{name}"
            for name in ("DEFAULT_TABLE", "mysql_ddl", "unpack_read", "upsert_claim")
        },
    },
)
