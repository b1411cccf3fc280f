"""Each record's own stale threshold on a key table 0001 of an earlier version created."""

from django.db import migrations

from idemflow.integrations.django.operations import _UpgradeKeyTable


class Migration(migrations.Migration):
    dependencies = [("idemflow", "0001_initial")]  # noqa: RUF012 -- Django's migration format
    operations = [_UpgradeKeyTable()]  # noqa: RUF012
