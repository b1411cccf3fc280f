"""
MySQL 8 and MariaDB (≥ 10.6): key records in InnoDB, on PyMySQL (`MySQLStore`)
or, from asyncio, on asyncmy (`AsyncMySQLStore`, the same statements and rules).

Neither server has ``UPDATE … RETURNING`` and ``INSERT IGNORE`` is out, so a
claim is a plain ``INSERT`` (error 1062: the key is held), then a packed read
of the current row, and, only for a row past its retention or released by
this same request, a guarded ``INSERT … ON DUPLICATE KEY UPDATE`` takeover
whose ownership is read off the lease token (never the affected-row count,
so ``CLIENT_FOUND_ROWS`` on or off is the same). Keys, principals and
fingerprints are ``VARBINARY``: ``*_bin`` collations are PAD SPACE. Why these
statements and the shapes measured and rejected: docs/stores.md, "MySQL 8 and
MariaDB" ("The claim statements, and why these", "Affected rows and
``CLIENT_FOUND_ROWS``", "Collations: keys are bytes").
"""

from __future__ import annotations

from ..._deprecation import moved
from ._async import AsyncMySQLStore
from ._binding import closed_by_server

# Not listed, shared: what idemflow.transactions' MySQL adapters and the Django store ask
# of the driver's errors, and the statements the Django store runs.
from ._errors import UNAVAILABLE_CODES as UNAVAILABLE_CODES
from ._errors import error_code as error_code
from ._errors import is_conflict as is_conflict
from ._errors import is_contention as is_contention
from ._errors import is_unavailable
from ._errors import rolled_back as rolled_back
from ._statements import DEFAULT_LOCK_WAIT_TIMEOUT
from ._statements import mysql_dialect as mysql_dialect
from ._statements import mysql_statements as mysql_statements
from ._sync import MySQLStore
from ._url import connect_kwargs

__all__ = [
    "DEFAULT_LOCK_WAIT_TIMEOUT",
    "AsyncMySQLStore",
    "MySQLStore",
    "closed_by_server",
    "connect_kwargs",
    "is_unavailable",
]

#: The adapters live with every other in `idemflow.transactions` (a store never
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
            for name in (
                "DEFAULT_TABLE",
                "SERVER_NOW_MS",
                "MySQLStatements",
                "mysql_ddl",
                "unpack_read",
                "upsert_claim",
            )
        },
    },
)
