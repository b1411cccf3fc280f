"""idemflow: make non-idempotent HTTP writes safe to retry.

Claim ``(principal, key)`` atomically, run the operation once, commit its outcome
in its own transaction, answer every retry alike. Imports no framework or driver."""

from ._async.driver import AsyncAttempt, AsyncIdempotency
from ._deprecation import moved as _moved_names
from ._downstream import downstream_key
from ._errors import (
    BodyTooLarge,
    ClientError,
    ConfigurationError,
    IdempotencyError,
    IncompleteBody,
    InProgress,
    InvalidBody,
    InvalidKey,
    KeyReused,
    LeaseLost,
    LengthRequired,
    MissingKey,
    MissingPrincipal,
    MissingTable,
    OutcomeUnknown,
    ReplayForbidden,
    ResponseNotStorable,
    StoreUnavailable,
)
from ._events import Event, Observer, fan_out
from ._identity import fingerprint, parse_key
from ._model import (
    Claim,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    State,
    Verdict,
    default_classifier,
)
from ._sync.driver import Attempt, Idempotency

__all__ = [
    "AsyncAttempt",
    "AsyncIdempotency",
    "Attempt",
    "BodyTooLarge",
    "Claim",
    "ClientError",
    "ConfigurationError",
    "Event",
    "Idempotency",
    "IdempotencyError",
    "InProgress",
    "IncompleteBody",
    "Intent",
    "InvalidBody",
    "InvalidKey",
    "KeyReused",
    "LeaseLost",
    "LengthRequired",
    "MissingKey",
    "MissingPrincipal",
    "MissingTable",
    "Observer",
    "Outcome",
    "OutcomeUnknown",
    "Policy",
    "Record",
    "ReplayForbidden",
    "Response",
    "ResponseNotStorable",
    "State",
    "StoreUnavailable",
    "Verdict",
    "default_classifier",
    "downstream_key",
    "fan_out",
    "fingerprint",
    "parse_key",
]

_moved = _moved_names(
    __name__,
    {
        "AsyncHandler": "idemflow._async.driver:AsyncHandler",
        "Handler": "idemflow._sync.driver:Handler",
        "Clock": "idemflow._model:Clock",
        "CountingObserver": "idemflow._events:CountingObserver",
        "MissingExtra": "idemflow._errors:MissingExtra",
        "canonical_json": "idemflow._identity:canonical_json",
    },
)


def __getattr__(name: str) -> object:
    if name != "__version__":
        return _moved(name)
    from importlib.metadata import version

    return version("idemflow")
