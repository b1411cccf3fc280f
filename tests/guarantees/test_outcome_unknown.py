"""
``OutcomeUnknown`` on every store, in every mode that has a durable claim, and at every edge.

A handler whose provider call timed out cannot tell whether the charge was made. It raises
``OutcomeUnknown``, and the rule of ``_flow._outcome_unknown`` keeps the claim instead of
releasing it: with two commits (the request's transaction still rolls back what it wrote
after its last ``commit_phase``), in single-commit mode past a committed phase, without a
transaction, in middleware mode. The caller gets it back unchanged (503 + ``Retry-After``
at an HTTP edge), a retry gets 409, and only the sweeper decides: its reconciler settles or
releases the key; without one it is released after the threshold and the retry resumes,
sending the provider the same downstream key. In single-commit mode before any
``commit_phase`` nothing is durable yet: the claim rolls back with the transaction.

The rigs and the request helpers are tests/guarantees/test_phase_rules.py's (tests/backends.py
``open_rig``: store and application share a pool of one connection); the provider honours
no downstream key, so without the rule every retry below would charge a second time.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncIdempotency, InProgress, OutcomeUnknown, State
from idemflow.sweeper import AsyncSweeper, Sweeper
from idemflow.testing import FrozenClock
from tests.backends import Rig, open_rig, rig_params
from tests.guarantees.test_phase_rules import (
    CHARGE,
    PHASE,
    POLICY,
    Script,
    World,
    record_of,
    run,
    sweep,
    transactional_modes,
    without_rows,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

#: POLICY's sweeper horizon (stale threshold plus one interval): the 503's Retry-After.
SWEPT_WITHIN = math.ceil(POLICY.stale_seconds + POLICY.sweep_interval)
#: A committed phase (a pending payment), a row in the next one, the charge, no answer.
UNKNOWN_PAST_A_PHASE = Script(("write:payment", "phase", "write:attempt", "call", "unknown"))
#: The same call without a phase before it.
UNKNOWN_WITHOUT_A_PHASE = Script(("write:attempt", "call", "unknown"))


async def sweep_without_a_reconciler(world: World) -> Any:
    """The sweeper with no reconciler, once the stale threshold has passed: it releases."""
    world.clock.advance(POLICY.stale_seconds + 1)
    rig = world.rig
    if rig.sync:
        return await asyncio.to_thread(Sweeper(rig.store, POLICY, clock=world.clock).sweep_once)
    return await AsyncSweeper(rig.store, POLICY, clock=world.clock).sweep_once()


@pytest.mark.parametrize(("kind", "single_commit"), list(transactional_modes()))
async def test_an_unknown_outcome_keeps_the_claim_in_the_transactional_modes(
    kind: str, single_commit: bool, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """The provider call after a committed phase times out: the claim stays ``in_progress``
    at its recovery point, what the open phase wrote rolls back, the retry gets 409 instead
    of charging again, and the sweeper's reconciler settles the charge into the replay. With
    two commits the claim is durable without a phase too (nothing of the request's own
    stays); in single-commit mode there it rolls back with everything else."""
    async with open_rig(kind, table_name, tmp_path, transactional=True) as rig:
        world = World(rig, clock)
        unknowns = {}
        for key, script in [("past", UNKNOWN_PAST_A_PHASE), ("before", UNKNOWN_WITHOUT_A_PHASE)]:
            with pytest.raises(OutcomeUnknown) as raised:
                await run(world, script, key, single_commit=single_commit)
            unknowns[key] = raised.value
        past, before = await record_of(rig, "past"), await record_of(rig, "before")
        with pytest.raises(InProgress) as busy:
            await run(world, CHARGE, "past", single_commit=single_commit)
        rows = rig.notes()
        report = await sweep(world)
        replay = await run(world, CHARGE, "past", single_commit=single_commit)

    assert unknowns["past"].retry_after == SWEPT_WITHIN
    assert past is not None
    assert (past.state, past.recovery_point) == (State.IN_PROGRESS, PHASE)
    assert busy.value.retry_after >= 1
    assert rows == ["payment"]  # the committed phase; the open one rolled back
    assert (replay.replayed, replay.response.status) == (True, 201)
    assert world.charged("past") == 1
    if single_commit:
        assert before is None  # nothing durable before the first commit_phase
        assert report.completed == 1
    else:
        assert before is not None
        assert (before.state, before.recovery_point) == (State.IN_PROGRESS, None)
        assert report.completed == 2  # the reconciler found both charges


@pytest.mark.parametrize("kind", rig_params("no-transaction", cluster=False))
async def test_an_unknown_outcome_keeps_the_claim_without_a_transaction(
    kind: str, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """Without a transaction the claim is durable from the start, on every store: 409 to
    the retry, then the reconciler settles it ("known"); without a reconciler the sweeper
    releases it and the retry resumes at its checkpoint with the same downstream key, which
    a provider honouring downstream keys would de-duplicate ("resumed")."""
    retry = without_rows(CHARGE)  # no business table without a transaction
    async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
        world = World(rig, clock)
        for key in ("known", "resumed"):
            with pytest.raises(OutcomeUnknown):
                await run(world, Script(("phase", "call", "unknown")), key)
            with pytest.raises(InProgress):
                await run(world, retry, key)
            held = await record_of(rig, key)
            assert held is not None
            assert (held.state, held.recovery_point) == (State.IN_PROGRESS, PHASE)
            if key == "known":
                reconciled = await sweep(world)
            else:
                released = await sweep_without_a_reconciler(world)
            outcome = await run(world, retry, key)
            if key == "known":
                assert (outcome.replayed, outcome.response.status) == (True, 201)
            else:
                assert (outcome.replayed, outcome.response.status) == (False, 201)

    assert (reconciled.completed, released.released) == (1, 1)
    assert world.charged("known") == 1
    resumed = [downstream for key, downstream in world.charges if key == "resumed"]
    assert len(resumed) == 2
    assert len(set(resumed)) == 1  # the resumed call carries the first one's downstream key


# --- the HTTP edges: 503 + Retry-After, the claim kept -----------------------------------


def assert_outcome_unknown(status: int, headers: Any, body: bytes) -> None:
    problem = json.loads(body)
    assert status == 503
    assert problem["type"] == "https://idemflow.dev/problems/outcome-unknown"
    assert problem["retryable"] is True
    assert int(headers["retry-after"]) >= SWEPT_WITHIN


@pytest.mark.parametrize("kind", rig_params("no-transaction", ("async",), cluster=False))
async def test_the_middleware_keeps_the_claim_of_an_endpoint_whose_outcome_is_unknown(
    kind: str, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """``IdempotencyMiddleware`` on every async store: the endpoint charged, then raised
    ``OutcomeUnknown``. A 503 outcome-unknown problem with ``Retry-After``, 409 to the retry
    (not a second charge), the reconciler's settlement replayed."""
    from starlette.requests import Request
    from starlette.responses import Response as StarletteResponse

    from tests.guarantees.test_modes import call_asgi, middleware_app, status_of

    async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
        world = World(rig, clock)

        async def create(request: Request) -> StarletteResponse:
            key = request.headers["idempotency-key"]
            world.charges.append((key, key))
            raise OutcomeUnknown("the provider did not answer")

        app = middleware_app(AsyncIdempotency(rig.store, POLICY, clock=clock), create)
        first = await call_asgi(app, "k-mw")
        retry = await call_asgi(app, "k-mw")
        held = await rig.call("get", "carol", "k-mw")
        report = await _reconciled_sweep(rig, world, clock)
        replay = await call_asgi(app, "k-mw")

    start = next(m for m in first if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in first if m["type"] == "http.response.body")
    assert_outcome_unknown(status_of(first), headers, body)
    assert status_of(retry) == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert report.completed == 1
    assert status_of(replay) == 201
    assert world.charged("k-mw") == 1


async def _reconciled_sweep(rig: Rig, world: World, clock: FrozenClock) -> Any:
    from idemflow.sweeper import DidNotHappen, Happened
    from tests.factories import CREATED

    async def reconciler(record: Any, keys: Any) -> Any:
        return Happened(CREATED) if world.charged(record.key) else DidNotHappen()

    clock.advance(POLICY.stale_seconds + 1)
    return await AsyncSweeper(rig.store, POLICY, reconciler=reconciler, clock=clock).sweep_once()
