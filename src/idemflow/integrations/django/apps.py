"""The Django app: ``INSTALLED_APPS = [..., "idemflow.integrations.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class IdemflowConfig(AppConfig):
    """Holds the key table's migration and the ``idemflow_sweep``/``idemflow_purge`` commands."""

    name = "idemflow.integrations.django"
    label = "idemflow"
    verbose_name = "idemflow (Idempotency-Key records)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from .conf import idemflow_settings

        idemflow_settings()  # a mistake in settings.IDEMFLOW fails at start-up, not per request
