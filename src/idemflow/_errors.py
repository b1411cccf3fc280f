"""
The one exception tree of idemflow.

Client errors carry their HTTP meaning (``status``, a problem ``type``, a
``title`` and whether the same request may be sent again, ``retryable``) so
every integration renders them the same way; each ``type`` URI is a page of
the documentation (``docs/problems/<slug>.md``). The handler's own exceptions
are never wrapped; :class:`OutcomeUnknown` is the one a handler raises on
purpose, to keep the claim for the sweeper. The tree, with each error's
status: docs/core.md, "Errors and their HTTP meaning".
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar

__all__ = [
    "BodyTooLarge",
    "ClientError",
    "ConfigurationError",
    "IdempotencyError",
    "InProgress",
    "IncompleteBody",
    "InvalidBody",
    "InvalidKey",
    "KeyReused",
    "LeaseLost",
    "MissingExtra",
    "MissingKey",
    "MissingPrincipal",
    "MissingTable",
    "OutcomeUnknown",
    "ReplayForbidden",
    "ResponseNotStorable",
    "StoreUnavailable",
    "problem_types",
]

PROBLEM_BASE = "https://idemflow.dev/problems/"


class IdempotencyError(Exception):
    """Root of every error idemflow raises itself."""

    __module__ = "idemflow"

    status: int = 500
    slug: str = "idempotency-error"
    title: str = "Idempotency error"
    #: Whether the same request, unchanged and under the same key, may be sent
    #: again (after ``Retry-After`` where there is one) and can then succeed.
    #: The problem body's ``retryable`` member; defined here, once per type.
    retryable: ClassVar[bool] = False

    @property
    def detail(self) -> str:
        return str(self) or self.title

    @property
    def problem_type(self) -> str:
        return PROBLEM_BASE + self.slug


class ClientError(IdempotencyError):
    """The request cannot be served as sent; the HTTP status says what to do."""

    __module__ = "idemflow"


class MissingKey(ClientError):
    """The endpoint requires an ``Idempotency-Key`` header and none was sent."""

    __module__ = "idemflow"
    status = 400
    slug = "missing-key"
    title = "Idempotency-Key is missing"


class InvalidKey(ClientError, ValueError):
    """The ``Idempotency-Key`` value is malformed (length, characters, a list, repeated)."""

    __module__ = "idemflow"
    status = 400
    slug = "invalid-key"
    title = "Idempotency-Key is malformed"


class InvalidBody(ClientError, ValueError):
    """The body cannot be fingerprinted: over the size cap, or not the JSON it claims to be."""

    __module__ = "idemflow"
    status = 400
    slug = "invalid-body"
    title = "Request body cannot be fingerprinted"


class BodyTooLarge(InvalidBody):
    """The body is over the cap: refused as soon as that is known, before it is all read."""

    __module__ = "idemflow"
    status = 413
    slug = "body-too-large"
    title = "Request body too large"


class IncompleteBody(InvalidBody):
    """The body did not arrive whole (the client went away): never fingerprinted or run."""

    __module__ = "idemflow"
    slug = "incomplete-body"
    title = "Request body did not arrive whole"
    retryable = True


class LengthRequired(InvalidBody):
    """A body sent without its length (chunked) to a server that cannot say where it ends."""

    __module__ = "idemflow"
    status = 411
    slug = "length-required"
    title = "Request body needs its Content-Length"


class MissingPrincipal(ClientError):
    """No authenticated principal: keys are never claimed anonymously."""

    __module__ = "idemflow"
    status = 401
    slug = "missing-principal"
    title = "Authentication required"


class ReplayForbidden(ClientError):
    """The stored response exists but this principal may no longer see it."""

    __module__ = "idemflow"
    status = 403
    slug = "replay-forbidden"
    title = "Replay not permitted"


class InProgress(ClientError):
    """A request with this key is still running; retry after ``retry_after`` seconds.

    Never waits for the other request: a held connection per duplicate is how
    a burst of retries becomes an outage.
    """

    __module__ = "idemflow"
    status = 409
    slug = "in-progress"
    title = "A request is outstanding for this Idempotency-Key"
    retryable = True

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LeaseLost(InProgress):
    """Our claim was taken over (swept as stale, or expired) before we completed.

    Raised from the completion compare-and-swap: the caller's transaction is
    rolled back, so a claim lost to the sweeper can never commit a second effect.
    """

    __module__ = "idemflow"
    slug = "lease-lost"
    title = "The claim on this Idempotency-Key was lost"


class KeyReused(ClientError):
    """The key was first used for a different request (body, method or route)."""

    __module__ = "idemflow"
    status = 422
    slug = "key-reused"
    title = "Idempotency-Key is already used"


class StoreUnavailable(IdempotencyError):
    """The key store could not be reached; the operation did not run."""

    __module__ = "idemflow"
    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"
    retryable = True

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OutcomeUnknown(IdempotencyError):
    """Raise it from a handler that cannot tell whether its external effect happened.

    A provider call that timed out, or whose connection broke after the request
    was sent: the charge may or may not have been made. Any other exception
    releases the key (a handler that raised did nothing), and a retry would
    make the call again; this one keeps the claim wherever it is durable (two
    commits, single-commit past a ``commit_phase``, no transaction,
    middleware), so a retry gets ``409`` until the sweeper's reconciler settles
    or releases it (without a reconciler the sweeper releases it after the
    stale threshold and the retry resumes: safe with a downstream key). The
    request's own transaction still rolls back what it wrote since its last
    ``commit_phase``. In single-commit mode before the first ``commit_phase``
    nothing is durable yet and the claim rolls back with the rest: make
    external calls after one.

    The caller gets a ``503`` with ``Retry-After``: ``retry_after`` is raised
    to when the sweeper will have passed when the claim is kept. Raised
    unchanged (the same object) out of ``run``.
    """

    __module__ = "idemflow"
    status = 503
    slug = "outcome-unknown"
    title = "The outcome of this request is not known yet"
    retryable = True

    def __new__(cls, *args: Any, **kwargs: Any) -> OutcomeUnknown:
        # In __new__, which every subclass runs (its own __init__ may not call ours).
        made = super().__new__(cls, *args, **kwargs)
        witness = OUTCOME_UNKNOWN_WITNESS.get()
        if witness is not None:
            witness(made)
        return made

    def __init__(self, message: str = "", *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


#: Told of every ``OutcomeUnknown`` made in this context: a middleware sets it while the
#: application it protects runs, so an ``OutcomeUnknown`` its framework turned into a 500
#: of its own is known without any hook of the framework's (see ``idemflow._http.OutcomeSlot``).
OUTCOME_UNKNOWN_WITNESS: ContextVar[Callable[[OutcomeUnknown], None] | None] = ContextVar(
    "idemflow.outcome_unknown_witness", default=None
)


class ConfigurationError(IdempotencyError, ValueError):
    """Settings that would break a guarantee (e.g. a stale threshold under the request timeout)."""

    __module__ = "idemflow"


class ResponseNotStorable(ConfigurationError):
    """The handler's response cannot be stored for replay: too large, streamed, or unsendable.

    In transactional mode it is raised inside the operation, so the operation's
    own writes roll back and the claim is released. Where the effect is not
    ours to roll back (middleware mode, no transaction) the record is settled
    with a ``response-not-stored`` marker instead (see ``idemflow._http``).
    Never replayed empty.
    """

    __module__ = "idemflow"
    status = 500
    slug = "response-not-storable"
    title = "Response cannot be stored for replay"

    def __init__(self, message: str = "", *, response: Any = None) -> None:
        super().__init__(message)
        #: What the endpoint answered, as far as it could be read: an idemflow ``Response``
        #: with its status and headers, no body (what a ``response-not-stored`` marker
        #: names). Typed ``Any``: the exception tree sits below the model, never above it.
        self.response = response


class MissingExtra(ConfigurationError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    Also an ``ImportError``, so ``except ImportError`` around an optional
    integration keeps working.
    """

    __module__ = "idemflow"

    def __init__(self, needed_by: str, module: str, extra: str) -> None:
        super().__init__(f"{needed_by} needs {module}: pip install 'idemflow[{extra}]'")
        self.name = module
        self.extra = extra


class MissingTable(ConfigurationError):
    """The store's key table does not exist: it was never migrated (``idemflow migrate URL``)."""

    __module__ = "idemflow"
    status = 500
    slug = "store-not-migrated"
    title = "The idempotency key table does not exist"


def problem_types() -> dict[str, type[IdempotencyError]]:
    """Every problem type idemflow's errors answer with: slug → the error class naming it.

    A subclass that keeps its parent's slug (``ConfigurationError``) shares
    its parent's type.
    """
    found: dict[str, type[IdempotencyError]] = {}
    pending: list[type[IdempotencyError]] = [IdempotencyError]
    while pending:
        error = pending.pop()
        found.setdefault(error.slug, error)
        pending += error.__subclasses__()
    return found


def driver_error(exc: BaseException) -> BaseException:
    """The database driver's own error behind a library's wrapper of it, else ``exc``.

    SQLAlchemy keeps it as ``.orig``; Django raises its ``django.db.utils`` errors
    from it (``__cause__``). The stores' rules (what is an outage, a lock timeout)
    judge the driver's error, as the caller's transaction adapters raise it wrapped:
    from the ``BEGIN`` of the request's transaction (a Django pool's ``PoolTimeout``),
    or from a claim in that transaction (single commit).
    """
    original = getattr(exc, "orig", None)
    if original is not None:
        return original  # type: ignore[no-any-return]
    if exc.__cause__ is not None and type(exc).__module__ == "django.db.utils":
        return exc.__cause__
    return exc
