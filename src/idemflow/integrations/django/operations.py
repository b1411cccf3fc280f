"""The migration operation that creates the key table with the ``CREATE`` statements of
[`DjangoStore`][idemflow.stores.django.DjangoStore]'s dialect: ``idemflow migrate``'s schema."""

from __future__ import annotations

from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation

from ..._deprecation import moved
from .conf import idemflow_settings

# The app's own migration names CreateKeyTable by its path: not API (as the app's other modules).
__all__: list[str] = []


def _key_table_ddl(vendor: str, table: str) -> list[str]:
    """The ``CREATE TABLE``/``CREATE INDEX`` statements idemflow runs on ``vendor``."""
    from ...stores.django import dialect_for

    return [s for s in dialect_for(vendor, table).ddl if s.lstrip().upper().startswith("CREATE")]


class CreateKeyTable(Operation):
    """Create (backwards: drop) ``IDEMFLOW['table']`` on ``IDEMFLOW['database']`` (if routed)."""

    reversible = True
    reduces_to_sql = True

    def state_forwards(self, app_label: str, state: Any) -> None:
        return  # no model: the table is idemflow's, read and written by its own SQL

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        table = self._table_for(app_label, schema_editor)
        if table is None:
            return
        for statement in _key_table_ddl(schema_editor.connection.vendor, table):
            schema_editor.execute(statement, params=None)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        table = self._table_for(app_label, schema_editor)
        if table is not None:
            schema_editor.execute(f"DROP TABLE IF EXISTS {table}", params=None)

    def describe(self) -> str:
        return "Create idemflow's key table (settings.IDEMFLOW['table'])"

    @property
    def migration_name_fragment(self) -> str:
        return "idemflow_keys"

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{__name__}.{type(self).__name__}", [], {})

    @staticmethod
    def _table_for(app_label: str, schema_editor: Any) -> str | None:
        chosen = idemflow_settings()
        alias = schema_editor.connection.alias
        if alias != chosen.database or not router.allow_migrate(alias, app_label):
            return None
        return chosen.table


class _UpgradeKeyTable(CreateKeyTable):
    """Give a key table an earlier version created each record's own stale threshold (the
    statements ``idemflow migrate`` runs on it); nothing on a table created as it is now."""

    reduces_to_sql = False  # it asks the database what the table holds

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        from ...stores.django import dialect_for

        table = self._table_for(app_label, schema_editor)
        connection = schema_editor.connection
        if table is None:
            return
        with connection.cursor() as cursor:
            if table not in connection.introspection.table_names(cursor):
                return
            described = connection.introspection.get_table_description(cursor, table)
        if "stale_at" in {column.name for column in described}:
            return
        dialect = dialect_for(connection.vendor, table)
        index = [s for s in dialect.ddl if "_state_stale ON" in s]
        for statement in [*dialect.upgrade, *index]:
            if statement.lstrip().upper().startswith(("ALTER", "UPDATE", "CREATE")):
                schema_editor.execute(statement, params=None)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        return  # the columns stay: an earlier version ignores them

    def describe(self) -> str:
        return "Give idemflow's key table each record's own stale threshold"


#: Issue 32: the migration's own; importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(__name__, {"key_table_ddl": f"{__name__}:_key_table_ddl"})
