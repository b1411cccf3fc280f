"""The Django app: ``INSTALLED_APPS = [..., "idemflow.integrations.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class IdemflowConfig(AppConfig):
    """The key table's migration, the management commands, the ``OutcomeUnknown`` receiver."""

    name = "idemflow.integrations.django"
    label = "idemflow"
    verbose_name = "idemflow (Idempotency-Key records)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import got_request_exception

        from .conf import idemflow_settings, observer_of
        from .views import _outcome_unknown_received, check_replay_authorizer

        chosen = idemflow_settings()  # a mistake in settings.IDEMFLOW fails at start-up
        # Paths imported here, outside the settings' lock (decorating views reads the settings).
        check_replay_authorizer(chosen)
        observer_of(chosen)
        # Behind an idemflow middleware a view's OutcomeUnknown keeps the claim, not a 500.
        got_request_exception.connect(_outcome_unknown_received, dispatch_uid="idemflow.outcome")
