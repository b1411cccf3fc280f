"""The Django app: ``INSTALLED_APPS = [..., "idemflow.integrations.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class IdemflowConfig(AppConfig):
    """Holds the key table's migration and the ``idemflow_sweep``/``idemflow_purge`` commands,
    and tells an idemflow WSGI/ASGI middleware about a view's ``OutcomeUnknown``."""

    name = "idemflow.integrations.django"
    label = "idemflow"
    verbose_name = "idemflow (Idempotency-Key records)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import got_request_exception

        from .conf import idemflow_settings, observer_of
        from .views import _outcome_unknown_received, check_replay_authorizer

        chosen = idemflow_settings()  # a mistake in settings.IDEMFLOW fails at start-up
        # Their paths are imported here, once the settings' lock is free: a module may hold
        # @idempotent views too, which read the settings as they are decorated.
        check_replay_authorizer(chosen)
        observer_of(chosen)
        # Behind a WSGI/ASGI idemflow middleware, a view's OutcomeUnknown must keep
        # the claim, not become the 500 that releases it (see _outcome_unknown_received).
        got_request_exception.connect(_outcome_unknown_received, dispatch_uid="idemflow.outcome")
