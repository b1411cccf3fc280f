"""The machinery of `idemflow.tracing`: one traced run, its span and what its events said."""

from __future__ import annotations

import dataclasses
import re
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ._errors import ClientError, ConfigurationError, LeaseLost
from ._events import Event
from ._model import Intent, Outcome, Policy, Verdict

try:
    from opentelemetry import context as _context
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - covered by a subprocess test without it
    _context = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext, Tracer

#: True when ``opentelemetry-api`` is importable; everything here is a no-op otherwise.
ENABLED = _trace is not None

SPAN_NAME = "idemflow.run"
_TRACER_NAME = "idemflow"
_TRACEPARENT = re.compile(r"\b00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\b")

# Events that decide what kind of answer a request got; the others only set the state.
_OUTCOMES = frozenset(Event) - {Event.COMPLETED, Event.RELEASED, Event.RELEASE_FAILED}
_STATE_AFTER = {
    Event.CLAIMED: "in_progress",
    Event.COMPLETED: "completed",
    Event.RELEASED: "released",
    Event.RELEASE_FAILED: "in_progress",
}


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent``, or None (no valid span, or no OpenTelemetry)."""
    if _trace is None:
        return None
    return _traceparent_of(_trace.get_current_span())


def linked_context(correlation_id: str | None) -> SpanContext | None:
    """The span context a stored correlation id names, if it holds a traceparent."""
    match = _TRACEPARENT.search(correlation_id or "")
    if _trace is None or match is None:
        return None
    trace_id, span_id, flags = (int(part, 16) for part in match.groups())
    context = _trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=_trace.TraceFlags(flags)
    )
    return context if context.is_valid else None


class TracingObserver:
    """An observer that annotates the current span with idemflow's outcome, state and endpoint."""

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        if _trace is None:
            return
        span = _trace.get_current_span()
        if not span.is_recording():
            return
        attributes = {"idemflow.endpoint": intent.endpoint or "unknown"}
        _note(event, attributes)
        span.set_attributes(attributes)
        span.add_event(f"idemflow.{event.value}", {"idemflow.elapsed_ms": elapsed * 1000})


def new_tracer(tracer: Tracer | None) -> Tracer:
    if _trace is None:
        msg = "tracing needs opentelemetry-api: pip install 'idemflow[tracing]'"
        raise ConfigurationError(msg)
    return tracer if tracer is not None else _trace.get_tracer(_TRACER_NAME)


class Run:
    """One traced run: its span (current until it exits), the intent as claimed, and what
    its events said, written to the span once at the end (each write validates its values)."""

    def __init__(self, tracer: Tracer, intent: Intent, policy: Policy) -> None:
        assert _trace is not None
        endpoint = intent.endpoint or "unknown"
        self.span = span = tracer.start_span(SPAN_NAME, attributes={"idemflow.endpoint": endpoint})
        self._span_token = _context.attach(_trace.set_span_in_context(span))
        self._run_token = _CURRENT_RUN.set(self)
        self.tracer = tracer
        self.policy = policy
        self.recording = span.is_recording()  # sampled out: nothing to write at the end
        self.attributes: dict[str, str | int | float] = {}
        if intent.correlation_id is None and (own := _traceparent_of(span)) is not None:
            intent = dataclasses.replace(intent, correlation_id=own)
        self.intent = intent

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if error is not None:
            self._fail(error)
        _CURRENT_RUN.reset(self._run_token)
        _context.detach(self._span_token)
        self.span.end()

    def finish(self, outcome: Outcome) -> None:
        if not self.recording:
            return
        attributes = self.attributes
        if outcome.replayed:
            attributes["idemflow.state"] = outcome.record.state.value
            self._link_original(outcome.record.correlation_id)
        else:
            verdict = self.policy.verdict(outcome.response)
            # A transient answer leaves what its release did: released, or in_progress.
            attributes["idemflow.state"] = (
                attributes.get("idemflow.state", "released")
                if verdict is Verdict.TRANSIENT
                else str(verdict.value)
            )
        self.span.set_attributes(attributes)

    def _fail(self, exc: BaseException) -> None:
        """Write what the events said; outages and crashes also fail the span."""
        if not self.recording:
            return
        self.span.set_attributes(self.attributes)
        # 409/422 are outcomes; a lost lease (our work rolled back) is a failure.
        if not isinstance(exc, ClientError) or isinstance(exc, LeaseLost):
            assert _trace is not None
            self.span.record_exception(exc)
            self.span.set_status(_trace.Status(_trace.StatusCode.ERROR, type(exc).__name__))

    def _link_original(self, correlation_id: str | None) -> None:
        if correlation_id is None:
            return
        self.attributes["idemflow.original_correlation_id"] = correlation_id
        original = linked_context(correlation_id)
        if original is None:
            return
        attributes = {"idemflow.link": "original_request"}
        add_link = getattr(self.span, "add_link", None)
        if add_link is not None:
            add_link(original, attributes)
        else:  # opentelemetry-api < 1.23 links only at span start: a child carries it
            assert _trace is not None
            links = [_trace.Link(original, attributes)]
            self.tracer.start_span("idemflow.replay", links=links).end()


#: The traced run in progress in this thread or task (runs nest: a handler may run another).
_CURRENT_RUN: ContextVar[Run | None] = ContextVar("idemflow_traced_run", default=None)


def record_in_run(event: Event, intent: Intent, elapsed: float) -> None:
    """The observer `traced` adds: notes each event on the run it belongs to."""
    run = _CURRENT_RUN.get()
    if run is not None:
        _note(event, run.attributes)


def _note(event: Event, attributes: dict[str, Any]) -> None:
    if event in _OUTCOMES:
        attributes["idemflow.outcome"] = event.value
    if event in _STATE_AFTER:
        attributes["idemflow.state"] = _STATE_AFTER[event]


def _traceparent_of(span: Span) -> str | None:
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
