from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 -- Django's migration format
    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Payment",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("principal", models.CharField(max_length=255)),
                ("amount", models.IntegerField()),
                ("via", models.CharField(max_length=16)),
            ],
        )
    ]
