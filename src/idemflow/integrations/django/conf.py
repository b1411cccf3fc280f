"""``settings.IDEMFLOW``, checked at start-up (``ImproperlyConfigured``, never a 500 per
request); the store and driver made once per process. docs/frameworks/django.md, "Settings"."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from ... import ConfigurationError, Idempotency, Observer, Policy
from ..._model import route_policy
from ...edge import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    RoutePolicy,
    sync_replay_authorizer,
)
from ...stores.protocol import Store

__all__ = ["get_idempotency", "get_store"]

#: The store that lives on Django's own database connections.
DJANGO_STORE = "django"


@dataclass(frozen=True, slots=True)
class IdemflowSettings:
    """``settings.IDEMFLOW``, checked, with defaults filled in."""

    request_timeout: float | timedelta = 30
    retention: float | timedelta = 86400
    table: str = "idemflow_keys"
    database: str = "default"
    store: str = DJANGO_STORE
    clock: str = "database"
    single_commit: bool = False
    #: ``(request) -> str | None``, or its dotted path (default: ``request.user.pk``).
    principal: Any = None
    #: ``(record) -> bool``, or its dotted path: may ``record.principal`` see a replay?
    authorize_replay: Any = None
    #: ``"POST /payments/<int:pk>"`` templates, or a dict of them to a route's policy.
    endpoints: Sequence[str] | Mapping[str, Any] = ()
    #: Further middleware that must run before ``IdempotencyMiddleware``.
    auth_middleware: Sequence[str] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    exclude_fields: Sequence[str] = ()
    strict_key: bool = False
    #: Told every outcome: an object, or its dotted path (`observer_of`).
    observer: Observer | str | None = None

    @property
    def policy(self) -> Policy:
        return Policy(request_timeout=self.request_timeout, retention=self.retention)

    def route_policy(self, given: Any, where: str) -> RoutePolicy | None:
        """A view's or endpoint's Policy, or a dict of durations over these settings'
        (None: the settings'); ``ImproperlyConfigured`` if invalid."""
        app = self.policy
        try:
            if isinstance(given, Mapping):
                durations = {"request_timeout": self.request_timeout, "retention": self.retention}
                given = Policy(**{**durations, **given})
            if given is None or callable(given):  # none, or a resolver: checked per request
                return cast(RoutePolicy | None, given)
            if not isinstance(given, Policy):
                msg = f"must be a Policy or a dict of its durations, got {given!r}"
                raise ConfigurationError(msg)
            return route_policy(given, app)
        except (ConfigurationError, TypeError) as exc:
            raise ImproperlyConfigured(f"{where}: {exc}") from exc


def idemflow_settings() -> IdemflowSettings:
    """The checked settings (once, again after ``setting_changed``); else ImproperlyConfigured."""
    with _lock:
        return _checked()


@functools.cache
def _checked() -> IdemflowSettings:
    given = getattr(settings, "IDEMFLOW", {}) or {}
    if not isinstance(given, Mapping):
        raise ImproperlyConfigured("settings.IDEMFLOW must be a dict")
    known = {field.name: field.default for field in fields(IdemflowSettings)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        msg = f"settings.IDEMFLOW has unknown keys {unknown}; known: {sorted(known)}"
        raise ImproperlyConfigured(msg)
    merged = {**known, **given}
    if merged["database"] not in settings.DATABASES:
        msg = f"settings.IDEMFLOW['database'] = {merged['database']!r} is not in DATABASES"
        raise ImproperlyConfigured(msg)
    for name in ("table", "store", "database"):
        if not isinstance(merged[name], str) or not merged[name]:
            raise ImproperlyConfigured(f"settings.IDEMFLOW[{name!r}] must be a non-empty str")
    if isinstance(merged["exclude_fields"], str):  # would be read as its letters
        msg = "settings.IDEMFLOW['exclude_fields'] must be a list of field names, not a str"
        raise ImproperlyConfigured(msg)
    chosen = IdemflowSettings(**merged)
    try:
        chosen.policy  # noqa: B018 -- durations are checked where they are defined
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"settings.IDEMFLOW: {exc}") from exc
    if chosen.clock not in ("database", "caller"):
        raise ImproperlyConfigured("settings.IDEMFLOW['clock'] must be 'database' or 'caller'")
    _check_replay_hook(chosen.authorize_replay)
    if not isinstance(chosen.observer, str):
        observer_of(chosen)  # an object is checked now; a path once imported (AppConfig.ready)
    return chosen


def _check_replay_hook(hook: Any) -> None:
    """A callable is checked now; a path is imported by ``AppConfig.ready``, outside the lock
    (a module of ``@idempotent`` views reads the settings as it is imported)."""
    if hook is None or (isinstance(hook, str) and hook):
        return
    try:
        sync_replay_authorizer(hook, "settings.IDEMFLOW['authorize_replay']")
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from exc


_lock = threading.Lock()


@functools.cache
def _built() -> tuple[Store, Idempotency]:
    chosen = _checked()
    store: Store
    if chosen.store == DJANGO_STORE:
        from ...stores.django import DjangoStore

        store = DjangoStore(chosen.database, table=chosen.table, clock=chosen.clock)
    else:
        from ...stores.urls import open_store

        store = open_store(chosen.store, table=chosen.table, policy=chosen.policy)
    driver, observer = Idempotency(store, chosen.policy), observer_of(chosen)
    if observer is not None:
        driver.observer = observer
    return store, driver


def observer_of(chosen: IdemflowSettings) -> Observer | None:
    """``IDEMFLOW['observer']``: the object, or the one its path names (ImproperlyConfigured)."""
    given = chosen.observer
    try:
        found = import_string(given) if isinstance(given, str) else given
    except ImportError as exc:
        raise ImproperlyConfigured(f"settings.IDEMFLOW['observer']: {exc}") from exc
    if found is not None and (isinstance(found, type) or not callable(found)):
        msg = f"settings.IDEMFLOW['observer'] = {given!r} is not an observer (an instance)"
        raise ImproperlyConfigured(msg)
    return cast(Observer | None, found)


def get_store() -> Store:
    """The key store ``settings.IDEMFLOW`` names (made once per process)."""
    with _lock:
        return _built()[0]


def get_idempotency() -> Idempotency:
    """The driver on `get_store` with the configured policy."""
    with _lock:
        return _built()[1]


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("IDEMFLOW", "DATABASES"):
        with _lock:
            _checked.cache_clear()
            _built.cache_clear()


setting_changed.connect(_reset, dispatch_uid="idemflow-settings")
