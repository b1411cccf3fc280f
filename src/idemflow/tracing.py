"""
OpenTelemetry traces for idemflow (``idemflow[tracing]``); a no-op without ``opentelemetry-api``.

Use one of two: `traced` makes each ``run`` one span (a replay's linked to
the original's through the ``traceparent`` kept as its correlation id), or a
`TracingObserver` annotates whatever span is current. The attributes:
docs/operations.md, "Traces".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

from . import _spans
from ._async.driver import AsyncIdempotency
from ._async.tracing import AsyncTracedIdempotency
from ._deprecation import moved
from ._spans import TracingObserver, traceparent
from ._sync.driver import Idempotency
from ._sync.tracing import TracedIdempotency

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = [
    "TracingObserver",
    "traced",
    "traceparent",
]


@overload
def traced(idempotency: AsyncIdempotency, tracer: Tracer | None = None) -> AsyncIdempotency: ...
@overload
def traced(idempotency: Idempotency, tracer: Tracer | None = None) -> Idempotency: ...
def traced(
    idempotency: Idempotency | AsyncIdempotency, tracer: Tracer | None = None
) -> Idempotency | AsyncIdempotency:
    """``idempotency``, tracing every run with ``tracer`` (the global ``idemflow`` one);
    unchanged when OpenTelemetry is not installed."""
    if not _spans.ENABLED:
        return idempotency
    if isinstance(idempotency, AsyncIdempotency):
        return AsyncTracedIdempotency(idempotency, tracer)
    return TracedIdempotency(idempotency, tracer)


#: Issue 32: moved; importable with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"idemflow._spans:{name}" for name in ("ENABLED", "SPAN_NAME", "linked_context")},
)
