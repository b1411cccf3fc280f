"""
idemflow: make non-idempotent HTTP writes safe to retry.

Claim ``(principal, key)`` atomically, run the operation once, commit its outcome
in its own transaction, answer every retry alike. Imports no framework or driver.
"""

from ._async.driver import AsyncAttempt, AsyncHandler, AsyncIdempotency
from ._canonical import canonical_json
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
    MissingExtra,
    MissingKey,
    MissingPrincipal,
    MissingTable,
    OutcomeUnknown,
    ReplayForbidden,
    ResponseNotStorable,
    StoreUnavailable,
)
from ._events import CountingObserver, Event, Observer, fan_out
from ._fingerprint import fingerprint
from ._key import parse_key
from ._model import (
    Claim,
    Clock,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    State,
    Verdict,
    default_classifier,
)
from ._sync.driver import Attempt, Handler, Idempotency

__all__ = [
    "AsyncAttempt",
    "AsyncHandler",
    "AsyncIdempotency",
    "Attempt",
    "BodyTooLarge",
    "Claim",
    "ClientError",
    "Clock",
    "ConfigurationError",
    "CountingObserver",
    "Event",
    "Handler",
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
    "MissingExtra",
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
    "canonical_json",
    "default_classifier",
    "downstream_key",
    "fan_out",
    "fingerprint",
    "parse_key",
]


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib.metadata import version

        return version("idemflow")
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)
