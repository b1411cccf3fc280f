"""The SQL family: one executor for every relational store (`SQLStore` /
`AsyncSQLStore`, no SQL and no decision of their own), and the public
seam for adding a SQL database ([`idemflow.stores.sql.dialect`][idemflow.stores.sql.dialect]).
``docs/architecture.md`` ("Adding a store") walks through a new one.
"""

from ..._deprecation import moved
from ..protocol import Statement
from ._async import AsyncSQLStore

# Not listed, shared: the SQLite store's statistics, the CLI's missing-table rule.
from ._stats import SQLStats as SQLStats
from ._stats import missing_table_is_clear as missing_table_is_clear
from ._sync import SQLStore
from .dialect import PURGEABLE_SQL, Dialect, create_table, insert_claim, on_database_clock

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

#: ``SQLStatement`` of 0.1 is the contract's [`Statement`][idemflow.stores.protocol.Statement];
#: the missing-table rule is the stores' own (issue 32). Importable from here, with a
#: DeprecationWarning, until 0.3.
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
