"""idemflow's one exception tree, each error with its HTTP meaning (``status``, the problem
``type`` of ``docs/problems/<slug>.md``): docs/core.md, "Errors and their HTTP meaning"."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar

PROBLEM_BASE = "https://idemflow.dev/problems/"


class IdempotencyError(Exception):
    """Root of every error idemflow raises itself."""

    status: int = 500
    slug: str = "idempotency-error"
    title: str = "Idempotency error"
    #: May the same request be sent again under the same key (the problem's ``retryable``)?
    retryable: ClassVar[bool] = False

    @property
    def detail(self) -> str:
        return str(self) or self.title

    @property
    def problem_type(self) -> str:
        return PROBLEM_BASE + self.slug


class ClientError(IdempotencyError):
    """The request cannot be served as sent; the HTTP status says what to do."""


class MissingKey(ClientError):
    """The endpoint requires an ``Idempotency-Key`` header and none was sent."""

    status = 400
    slug = "missing-key"
    title = "Idempotency-Key is missing"


class InvalidKey(ClientError, ValueError):
    """The ``Idempotency-Key`` value is malformed (length, characters, a list, repeated)."""

    status = 400
    slug = "invalid-key"
    title = "Idempotency-Key is malformed"


class InvalidBody(ClientError, ValueError):
    """The body cannot be fingerprinted: over the size cap, or not the JSON it claims to be."""

    status = 400
    slug = "invalid-body"
    title = "Request body cannot be fingerprinted"


class BodyTooLarge(InvalidBody):
    """The body is over the cap: refused as soon as that is known, before it is all read."""

    status = 413
    slug = "body-too-large"
    title = "Request body too large"


class IncompleteBody(InvalidBody):
    """The body did not arrive whole (the client went away): never fingerprinted or run."""

    slug = "incomplete-body"
    title = "Request body did not arrive whole"
    retryable = True


class LengthRequired(InvalidBody):
    """A body sent without its length (chunked) to a server that cannot say where it ends."""

    status = 411
    slug = "length-required"
    title = "Request body needs its Content-Length"


class MissingPrincipal(ClientError):
    """No authenticated principal: keys are never claimed anonymously."""

    status = 401
    slug = "missing-principal"
    title = "Authentication required"


class ReplayForbidden(ClientError):
    """The stored response exists but this principal may no longer see it."""

    status = 403
    slug = "replay-forbidden"
    title = "Replay not permitted"


class InProgress(ClientError):
    """A request with this key is still running; retry after ``retry_after`` seconds."""

    status = 409
    slug = "in-progress"
    title = "A request is outstanding for this Idempotency-Key"
    retryable = True

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LeaseLost(InProgress):
    """Our claim was taken over before we completed: the caller's transaction rolls back."""

    slug = "lease-lost"
    title = "The claim on this Idempotency-Key was lost"


class KeyReused(ClientError):
    """The key was first used for a different request (body, method or route)."""

    status = 422
    slug = "key-reused"
    title = "Idempotency-Key is already used"


class StoreUnavailable(IdempotencyError):
    """The key store could not be reached; the operation did not run."""

    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"
    retryable = True

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OutcomeUnknown(IdempotencyError):
    """Raise it from a handler that cannot tell whether its external effect happened: the
    claim is kept for the sweeper (retries get 409) where any other exception releases it."""

    status = 503
    slug = "outcome-unknown"
    title = "The outcome of this request is not known yet"
    retryable = True

    def __new__(cls, *args: Any, **kwargs: Any) -> OutcomeUnknown:
        # Not in __init__: a subclass's own may not call ours.
        made = super().__new__(cls, *args, **kwargs)
        witness = OUTCOME_UNKNOWN_WITNESS.get()
        if witness is not None:
            witness(made)
        return made

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


#: Told of every ``OutcomeUnknown`` made in this context (``idemflow._http.OutcomeSlot``).
OUTCOME_UNKNOWN_WITNESS: ContextVar[Callable[[OutcomeUnknown], None] | None] = ContextVar(
    "idemflow.outcome_unknown_witness", default=None
)


class ConfigurationError(IdempotencyError, ValueError):
    """Settings that would break a guarantee (e.g. a stale threshold under the request timeout)."""


class ResponseNotStorable(ConfigurationError):
    """The handler's response cannot be stored for replay (too large, streamed, unsendable)."""

    status = 500
    slug = "response-not-storable"
    title = "Response cannot be stored for replay"

    def __init__(self, message: str = "", *, response: Any = None) -> None:
        super().__init__(message)
        self.response = response  # the endpoint's Response (status, headers), if any


class MissingExtra(ConfigurationError, ImportError):
    """An optional dependency is not installed (an ImportError too); the message names its extra."""

    def __init__(self, needed_by: str, module: str, extra: str) -> None:
        super().__init__(f"{needed_by} needs {module}: pip install 'idemflow[{extra}]'")
        self.name = module
        self.extra = extra


class MissingTable(ConfigurationError):
    """The store's key table does not exist: it was never migrated (``idemflow migrate URL``)."""

    status = 500
    slug = "store-not-migrated"
    title = "The idempotency key table does not exist"


def problem_types() -> dict[str, type[IdempotencyError]]:
    """Every problem type idemflow's errors answer with: slug → the first class naming it."""
    found: dict[str, type[IdempotencyError]] = {}
    pending: list[type[IdempotencyError]] = [IdempotencyError]
    while pending:
        error = pending.pop()
        found.setdefault(error.slug, error)
        pending += error.__subclasses__()
    return found


def driver_error(exc: BaseException) -> BaseException:
    """The driver's error behind SQLAlchemy's (``.orig``) or Django's wrapper, else ``exc``."""
    original = getattr(exc, "orig", None)
    if original is not None:
        return original  # type: ignore[no-any-return]
    if exc.__cause__ is not None and type(exc).__module__ == "django.db.utils":
        return exc.__cause__
    return exc


# Named ``idemflow.X`` in tracebacks and the reference.
for _error in (*problem_types().values(), ClientError, ConfigurationError, MissingExtra):
    _error.__module__ = "idemflow"
