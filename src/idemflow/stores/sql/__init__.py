"""The SQL family: one executor for every relational store (`SQLStore` / `AsyncSQLStore`), and
the seam for adding a SQL database ([`idemflow.stores.sql.dialect`][idemflow.stores.sql.dialect]).
"""

from ..._deprecation import moved
from ..protocol import Statement
from ._async import AsyncSQLStore

# Not listed, shared: the SQLite store's statistics, the CLI's missing-table rule.
from ._stats import SQLStats as SQLStats
from ._stats import missing_table_is_clear as missing_table_is_clear
from ._sync import SQLStore
from .dialect import (
    PURGEABLE_SQL,
    Dialect,
    create_table,
    insert_claim,
    on_database_clock,
)

__all__ = [
    "PURGEABLE_SQL",
    "AsyncSQLStore",
    "Dialect",
    "SQLStore",
    "Statement",
    "create_table",
    "insert_claim",
    "on_database_clock",
]

#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {
        "SQLStatement": "idemflow.stores.protocol:Statement",
        "is_missing_table": "idemflow.stores.sql._stats:is_missing_table",
        "StoreClock": "idemflow.stores.protocol:StoreClock",
        "check_clock": "idemflow.stores.protocol:check_clock",
        **{
            name: f"idemflow.stores.sql.dialect:{name}"
            for name in (
                "COLUMNS",
                "NEW_INTENT_SQL",
                "PAST_RETENTION_SQL",
                "RETRY_SQL",
                "SWEEPABLE_SQL",
                "TAKE_OVER_SQL",
                "row_mapping",
                "take_over_claim",
            )
        },
    },
)
