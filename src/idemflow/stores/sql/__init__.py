"""The SQL family: one executor for every relational store (:class:`SQLStore` /
:class:`AsyncSQLStore`, no SQL and no decision of their own), and the public
seam for adding a SQL database (:mod:`idemflow.stores.sql.dialect`).
``docs/architecture.md`` ("Adding a store") walks through a new one.
"""

from ..._deprecation import moved
from ..protocol import Statement, StoreClock, check_clock
from ._async import AsyncSQLStore
from ._stats import SQLStats, missing_table_is_clear
from ._sync import SQLStore
from .dialect import (
    COLUMNS,
    NEW_INTENT_SQL,
    PAST_RETENTION_SQL,
    PURGEABLE_SQL,
    RETRY_SQL,
    SWEEPABLE_SQL,
    TAKE_OVER_SQL,
    Dialect,
    create_table,
    insert_claim,
    on_database_clock,
    row_mapping,
    take_over_claim,
)

__all__ = [
    "COLUMNS",
    "NEW_INTENT_SQL",
    "PAST_RETENTION_SQL",
    "PURGEABLE_SQL",
    "RETRY_SQL",
    "SWEEPABLE_SQL",
    "TAKE_OVER_SQL",
    "AsyncSQLStore",
    "Dialect",
    "SQLStats",
    "SQLStore",
    "Statement",
    "StoreClock",
    "check_clock",
    "create_table",
    "insert_claim",
    "missing_table_is_clear",
    "on_database_clock",
    "row_mapping",
    "take_over_claim",
]

#: ``SQLStatement`` of 0.1 is the contract's :class:`~idemflow.stores.protocol.Statement`;
#: the missing-table rule is the stores' own (issue 32). Importable from here, with a
#: DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {
        "SQLStatement": "idemflow.stores.protocol:Statement",
        "is_missing_table": "idemflow.stores.sql._stats:is_missing_table",
    },
)
