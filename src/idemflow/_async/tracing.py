"""A traced driver: every run one span, ``idemflow.run``.
This is the async source of truth; ``idemflow/_sync/tracing.py`` is generated from it by
``scripts/unasync.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._events import fan_out
from .._model import Intent, Outcome
from .._spans import Run, new_tracer, record_in_run
from .driver import AsyncIdempotency

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class AsyncTracedIdempotency(AsyncIdempotency):
    """An `AsyncIdempotency` whose every run is a span (`traced`)."""

    def __init__(self, inner: AsyncIdempotency, tracer: Tracer | None = None) -> None:
        vars(self).update(vars(inner))  # same store, policy, clock; new attributes too
        self.observer = fan_out(inner.observer, record_in_run)
        self.tracer = new_tracer(tracer)

    async def run(self, intent: Intent, *args: Any, **kwargs: Any) -> Outcome:
        with Run(self.tracer, intent, self.policy) as run:
            outcome = await super().run(run.intent, *args, **kwargs)
            run.finish(outcome)
            return outcome
