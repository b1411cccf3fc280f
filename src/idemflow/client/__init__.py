"""idemflow.client: one ``Idempotency-Key`` per operation, retried safely within a deadline.
httpx: `IdempotentTransport`, `AsyncIdempotentTransport`; requests: `IdempotentAdapter`,
`idempotent_session`. Imports neither until used (``idemflow[client]``). See docs/client.md."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .._deprecation import moved
from ._keys import KeyForm
from ._retry import (
    DEFAULT_RETRY_STATUSES,
    OUTCOME_ATTRIBUTE,
    AttemptReport,
    RetryPolicy,
)
from ._retry import OUTCOME as _OUTCOME
from ._retry import (
    ClientOutcome as ClientOutcome,
)
from ._retry import is_replay as _is_replay

if TYPE_CHECKING:
    from ._httpx import DEADLINE, AsyncIdempotentTransport, IdempotentTransport
    from ._requests import IdempotentAdapter, idempotent_session

__all__ = [
    "DEADLINE",
    "DEFAULT_RETRY_STATUSES",
    "AsyncIdempotentTransport",
    "AttemptReport",
    "IdempotentAdapter",
    "IdempotentTransport",
    "KeyForm",
    "RetryPolicy",
    "idempotent_session",
    "outcome",
    "replayed",
]

_LAZY = {
    "DEADLINE": "_httpx",
    "AsyncIdempotentTransport": "_httpx",
    "IdempotentTransport": "_httpx",
    "IdempotentAdapter": "_requests",
    "idempotent_session": "_requests",
}
_NEEDS = {"_httpx": "httpx", "_requests": "requests"}

#: Importable from here with a DeprecationWarning until 0.3.
_moved = moved(
    __name__,
    {
        **{
            name: f"idemflow.client._retry:{name}"
            for name in (
                "DEFAULT_METHODS",
                "OUTCOME",
                "Decision",
                "Failure",
                "Operation",
                "Operations",
                "is_replay",
                "parse_retry_after",
            )
        },
        **{
            name: f"idemflow.client._keys:{name}"
            for name in ("KeyLedger", "KeyReusedLocally", "encode_key", "uuid4_key")
        },
    },
)


class _HasHeaders(Protocol):
    @property
    def headers(self) -> Any: ...


def outcome(response: object) -> ClientOutcome | None:
    """How the operation behind an httpx or requests ``response`` (or a redirect's, or an
    error a transport raised after its last attempt) went; None if not the client's."""
    found = _outcome_of(response)
    for earlier in reversed(getattr(response, "history", None) or ()):
        if found is not None:
            break
        found = _outcome_of(earlier)
    return found


def _outcome_of(response: object) -> ClientOutcome | None:
    extensions = getattr(response, "extensions", None)
    if isinstance(extensions, Mapping):
        found = extensions.get(_OUTCOME)
    else:
        found = getattr(response, OUTCOME_ATTRIBUTE, None)
    return found if isinstance(found, ClientOutcome) else None


def replayed(response: _HasHeaders) -> bool:
    """Is ``response`` the server's stored answer (``Idempotent-Replayed: true``)?"""
    return _is_replay(response.headers)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        return _moved(name)
    try:
        loaded = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        msg = (
            f"idemflow.client.{name} needs {_NEEDS[module]}: pip install 'idemflow[client]' ({exc})"
        )
        raise ImportError(msg) from exc
    return getattr(loaded, name)
