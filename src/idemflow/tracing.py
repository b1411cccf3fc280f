"""
OpenTelemetry traces for idemflow (``idemflow[tracing]``); a no-op without ``opentelemetry-api``.

Two ways in; use one of them: :func:`traced` wraps an ``Idempotency`` (or
``AsyncIdempotency``) so each ``run`` is one span, ``idemflow.run``, and a
replay's span *links* to the span of the request that produced the stored
response (through the W3C ``traceparent`` kept in the record's correlation
id, :func:`traceparent`); :class:`TracingObserver`, passed as (or fanned out
into) the observer, only annotates whatever span is current with the same
attributes and one span event per idemflow event. The attributes and how a
replay finds the original trace: docs/operations.md, "Traces". Nothing else
in idemflow imports OpenTelemetry.
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
    """``idempotency``, tracing every run (unchanged when OpenTelemetry is not installed).

    Args:
        tracer: defaults to the global tracer provider's ``idemflow`` tracer.
    """
    if not _spans.ENABLED:
        return idempotency
    if isinstance(idempotency, AsyncIdempotency):
        return AsyncTracedIdempotency(idempotency, tracer)
    return TracedIdempotency(idempotency, tracer)


#: Issue 32: whether OpenTelemetry is importable, and the span's name, are the tracer's
#: own; importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"idemflow._spans:{name}" for name in ("ENABLED", "SPAN_NAME", "linked_context")},
)
