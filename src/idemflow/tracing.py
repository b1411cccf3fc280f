"""
OpenTelemetry traces for idemflow (``idemflow[tracing]``); a no-op without ``opentelemetry-api``.

Two ways in; use one of them:

- :func:`traced` wraps an ``Idempotency`` (or ``AsyncIdempotency``) so each
  ``run`` is one span, ``idemflow.run``, around claim → dispatch → execute →
  complete, with the attributes ``idemflow.outcome``, ``idemflow.state`` and
  ``idemflow.endpoint``. A replay's span *links* to the span of the request
  that produced the stored response.
- :class:`TracingObserver`, passed as (or fanned out into) the observer,
  only annotates whatever span is current (your HTTP server span, say) with
  the same attributes and one span event per idemflow event. No span of its
  own, no link.

How a replay finds the original trace: the correlation id stored with each
record. When an ``Intent`` has no ``correlation_id``, :func:`traced` stores the
run span's W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``) there; on
a replay the stored value is parsed back into a span context for the link.
An app that sets its own correlation id keeps it; the replay is linked when
that id contains a traceparent (e.g. ``"req-42 00-4bf9…-00f0…-01"``), and the
original id is always set as ``idemflow.original_correlation_id``.

Nothing else in idemflow imports OpenTelemetry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

from . import _spans
from ._async.driver import AsyncIdempotency
from ._async.tracing import AsyncTracedIdempotency
from ._deprecation import moved
from ._spans import TracingObserver, linked_context, traceparent
from ._sync.driver import Idempotency
from ._sync.tracing import TracedIdempotency

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = [
    "AsyncTracedIdempotency",
    "TracedIdempotency",
    "TracingObserver",
    "linked_context",
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
    __name__, {name: f"idemflow._spans:{name}" for name in ("ENABLED", "SPAN_NAME")}
)
