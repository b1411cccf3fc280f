"""The key table, from idemflow's own DDL for the vendor being migrated (see ``operations``)."""

from django.db import migrations

from idemflow.integrations.django.operations import CreateKeyTable


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 -- Django's migration format
    operations = [CreateKeyTable()]  # noqa: RUF012
