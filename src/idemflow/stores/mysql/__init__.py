"""MySQL 8 and MariaDB (≥ 10.6): key records in InnoDB, on PyMySQL (`MySQLStore`) or, from
asyncio, on asyncmy (`AsyncMySQLStore`). A claim is a plain ``INSERT`` (1062: the key is
held), a takeover a guarded ``INSERT … ON DUPLICATE KEY UPDATE`` whose ownership is read off
the lease token: docs/stores.md, "MySQL 8 and MariaDB".
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
from ._statements import DEFAULT_LOCK_WAIT_TIMEOUT as DEFAULT_LOCK_WAIT_TIMEOUT
from ._statements import mysql_dialect as mysql_dialect
from ._statements import mysql_statements as mysql_statements
from ._sync import MySQLStore
from ._url import connect_kwargs

__all__ = [
    "AsyncMySQLStore",
    "MySQLStore",
    "closed_by_server",
    "connect_kwargs",
    "is_unavailable",
]

#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
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
