"""OpenTelemetry traces (``idemflow[tracing]``, else a no-op): `traced` makes each ``run`` a
span, a `TracingObserver` annotates the current one. docs/operations.md, "Traces"."""

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


__getattr__ = moved(
    __name__,
    {name: f"idemflow._spans:{name}" for name in ("ENABLED", "SPAN_NAME", "linked_context")},
)
