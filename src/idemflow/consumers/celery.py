"""Celery tasks with exactly-once effects (Celery imported only here): `exactly_once` runs a
task through `Consumer`, the principal its name, the fingerprint its arguments; each action
as Celery performs it: docs/consumers.md, "Celery"."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeAlias

from .. import Idempotency, Response
from .._errors import ConfigurationError
from .._extras import optional
from ..stores.protocol import Transaction
from ._decision import Decision, key_in
from ._sync import Consumer

with optional("idemflow.consumers.celery"):
    from celery import Celery, Task
    from celery.exceptions import Reject

__all__ = ["exactly_once"]

logger = logging.getLogger("idemflow")

#: The task's body: the claimed attempt, then the task's own arguments; its answer (a
#: JSON value) is the task's result, stored and returned again for every duplicate.
TaskHandler: TypeAlias = Callable[..., Any]

#: What the safety rests on: ack only once the outcome is settled, and requeue (never
#: ack) the message of a worker that died mid-task; its redelivery meets the claim.
_REQUIRED = {"acks_late": True, "reject_on_worker_lost": True}


def exactly_once(
    app: Celery,
    idempotency: Idempotency,
    *,
    key: str | Callable[..., str] = "idempotency_key",
    transaction: Callable[[], AbstractContextManager[Transaction]] | None = None,
    renew_every: float | None = None,
    **options: Any,
) -> Callable[[TaskHandler], Task]:
    """A decorator making ``handler(attempt, *args, **kwargs)`` a task of ``app`` whose
    effect happens once per key.

    ``key``: the task header holding the idempotency key (sent with
    ``apply_async(..., headers={"idempotency_key": ...})``), or a function of the
    task's arguments; never Celery's task id, which every ``delay()`` makes afresh.
    ``transaction``: a factory of the app's transaction per run, where the completion
    commits with the handler's writes before the ack. ``options`` go to ``app.task``.
    """
    for name, value in _REQUIRED.items():
        if options.setdefault(name, value) != value:
            msg = f"an exactly-once task needs {name}={value}: see docs/consumers.md, 'Celery'"
            raise ConfigurationError(msg)

    def decorate(handler: TaskHandler) -> Task:
        name = options.get("name") or app.gen_task_name(handler.__name__, handler.__module__)
        consumer = Consumer(idempotency, name, renew_every=renew_every)

        def run(task: Task, *args: Any, **kwargs: Any) -> Any:
            with transaction() if transaction else nullcontext(None) as opened:
                decision = consumer.handle(
                    lambda: _key(task, key, args, kwargs),
                    _payload(args, kwargs),
                    lambda attempt: handler(attempt, *args, **kwargs),
                    transaction=opened,
                )
            return _perform(task, decision)

        functools.update_wrapper(run, handler)  # the handler's name, module and doc
        # Celery checks a call's arguments against this (the attempt where a bound task's
        # self would be): a call that does not fit fails when sent, not on every retry.
        run.__signature__ = inspect.signature(handler)  # type: ignore[attr-defined]
        return app.task(**{**options, "bind": True, "name": name})(run)

    return decorate


def _perform(task: Task, decision: Decision) -> Any:
    if decision.action in ("ack", "ack_with_stored_result"):
        return _result(decision.response)
    if decision.action == "dead_letter":
        # Dead-lettered where the queue has a dead-letter exchange (RabbitMQ), else dropped.
        logger.error("task %s[%s] rejected: %s", task.name, task.request.id, decision.problem)
        raise Reject(str(decision.problem), requeue=False)
    # A new message after the delay (the worker slot free meanwhile), then this one acked.
    if decision.action != "release_and_requeue":
        # Waiting on another owner, the sweeper or the store (a claim always ends) is no
        # failure of this task: not counted against max_retries, where running out would
        # lose the job. (retry() counts from request.retries.)
        task.request.retries -= 1
    raise task.retry(countdown=decision.delay, exc=decision.problem)


def _result(response: Response | None) -> Any:
    """The stored answer as the task's result: a JSON value as it was, other bodies as text."""
    if response is None:
        return None
    if response.header("content-type") == "application/json":
        return response.json_body()
    return response.body.decode()


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The arguments as canonical JSON (what Celery's default serializer carried)."""
    content = {"args": list(args), "kwargs": kwargs}
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def _key(task: Task, key: str | Callable[..., str], args: Any, kwargs: dict[str, Any]) -> str:
    if callable(key):
        return key(*args, **kwargs)
    value = (task.request.headers or {}).get(key) or None  # an empty header is none too
    return key_in(value, f"the task has no {key!r} header")
