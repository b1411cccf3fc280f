"""
The demo payments service, a Starlette app built on idemflow's public API.

Middleware, outermost first: ``X-Request-Id`` on every response, then bearer
authentication (so the principal is known before any key is claimed), then the
routes. The two write endpoints use transactional mode
(:class:`idemflow.integrations.starlette.Idempotent`): they read the body
whole and bounded (413 over the cap, nothing run for a body cut short),
validate it (400, never recorded), then claim, and their business rows commit
with the completion. With the keys in Redis they cannot: the same endpoints
run in the no-transaction mode (:mod:`idemflow_demo.unshared`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.authentication import SimpleUser, UnauthenticatedUser
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idemflow import (
    AsyncIdempotency,
    Event,
    InvalidBody,
    MissingPrincipal,
    Policy,
    Record,
    Response,
    StoreUnavailable,
)
from idemflow.integrations.starlette import (
    EdgeOptions,
    Idempotent,
    RequestIdMiddleware,
    pooled_transaction,
    problem,
    problem_for,
    request_id,
    send_response,
    to_starlette,
)
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.postgres import is_unavailable as postgres_unavailable
from idemflow.stores.sqlite import is_unavailable as sqlite_unavailable
from idemflow.sweeper import AsyncBackgroundSweeper

from .databases import open_database
from .db import Database
from .faults import crash_point
from .payments import InvalidRequest, Payments, Phases, parse_payment, parse_refund, payment_json
from .provider import FakeProvider
from .recovery import start_recovery
from .settings import Settings
from .unshared import UnsharedIdempotent

__all__ = ["DemoService", "create_app"]

PROTECTED = ("POST /payments", "POST /payments/{id}/refunds")
PUBLIC_PATHS = frozenset({"/healthz", "/metrics", "/provider/charges"})

#: Seconds a start waits for a database that is down or too slow to hand out a
#: connection (restarting, or saturated by the backends of a process just killed),
#: trying again with backoff, before the demo gives up and exits.
DATABASE_PATIENCE_AT_START = 30.0

#: The key /healthz reads (a lookup that finds nothing: the key table answers).
HEALTH_PRINCIPAL, HEALTH_KEY = "idemflow-demo-healthz", "healthz"


class BearerAuth:
    """Pure-ASGI bearer authentication: sets ``scope["user"]`` or answers 401 (problem)."""

    def __init__(self, app: ASGIApp, *, tokens: Mapping[str, str]) -> None:
        self.app = app
        self.tokens = dict(tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal = self._principal(scope)
        scope["user"] = UnauthenticatedUser() if principal is None else SimpleUser(principal)
        if principal is None and scope["path"] not in PUBLIC_PATHS:
            # The library's own 401 (missing-principal), so the demo and docs/http.md agree.
            missing = MissingPrincipal("send Authorization: Bearer <token> with a known token")
            response = problem_for(missing, request_id(scope))
            headers = (*response.headers, ("www-authenticate", 'Bearer realm="idemflow-demo"'))
            await send_response(send, Response(response.status, response.body, headers))
            return
        await self.app(scope, receive, send)

    def _principal(self, scope: Scope) -> str | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return self.tokens.get(token.strip())
        return None


class DemoService:
    """The service's parts: database, provider, idempotency, metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = False
        self._opened = False  # has start() begun since the last stop()?
        #: The key store on a connection of its own (``Database.side_store``): the stuck-claims
        #: gauge and /healthz read through it, never queued behind requests. Set by start.
        self._side_store: Any = None
        #: The background sweeper with the provider reconciler, while started.
        self.recovery: AsyncBackgroundSweeper | None = None
        self.db: Database = open_database(
            settings.database_url,
            settings.sqlite_path,
            pool_size=settings.pool_size,
            claim_commit=settings.claim_commit,
        )
        self.provider = FakeProvider(
            settings.provider_path,
            latency_ms=settings.provider_latency_ms,
            failure_rate=settings.provider_failure_rate,
            rng=random.Random(settings.provider_seed),
        )
        self.metrics = PrometheusMetrics()
        policy = Policy(request_timeout=settings.request_timeout, retention=settings.retention)
        self.idempotency = AsyncIdempotency(self.db.store, policy, observer=self.metrics)
        self.payments = Payments(
            self.provider,
            self.db.wrap,
            self.db.connect,
            settings.request_timeout,
            transactional=self.db.transactional,
        )
        options = EdgeOptions(authorize_replay=self.may_replay)
        self.idempotent: Idempotent | UnsharedIdempotent
        if self.db.transactional:
            self.idempotent = Idempotent(
                self.idempotency,
                connect=self.db.connect,
                transaction=self.db.transaction,
                options=options,
                single_commit=self.db.single_commit,
            )
        else:  # keys in Redis: the business rows commit apart, before the completion
            self.idempotent = UnsharedIdempotent(
                self.idempotency,
                connect=self.db.connect,
                transaction=self.db.transaction,
                options=options,
            )
        for endpoint in PROTECTED:  # every outcome shows on /metrics from the start, at 0
            for event in Event:
                self.metrics.requests.labels(event.value, endpoint)

    async def may_replay(self, record: Record) -> bool:
        """Object-level check on replay: the payment the stored answer names is still theirs."""
        response = record.response
        location = response.header("location") if response else None
        if location is None or not location.startswith("/payments/"):
            return True
        payment_id = location.removeprefix("/payments/").split("/", 1)[0]
        return await self.payments.get(record.principal, payment_id) is not None

    async def start(self) -> None:
        """Open (and migrate) the database and the provider's ledger."""
        self._opened = True
        await self._open_database()
        self.provider.open()
        if self._side_store is None:  # idemflow_stale_in_progress{state}: crashed claims
            self._side_store = await asyncio.to_thread(self.db.side_store)
            self.metrics.watch_stale_claims(self._side_store, self.settings.request_timeout)
        if self.recovery is None:
            self.recovery = start_recovery(self)
        self.started = True

    async def _open_database(self) -> None:
        """Open the database, waiting out an outage for up to ``DATABASE_PATIENCE_AT_START``.

        A service started by its supervisor while the database restarts (or after
        a crash, while the server still serves the dead process's backends) should
        come up once the database does, not exit on its first pool timeout.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DATABASE_PATIENCE_AT_START
        pause = 0.1
        while True:
            try:
                await self.db.open()
            except Exception as exc:
                if not _outage(exc) or loop.time() + pause > deadline:
                    raise
                print(
                    f"idemflow demo: the database is unavailable at start-up "
                    f"({type(exc).__name__}: {exc}); trying again in {pause:g} s",
                    file=sys.stderr,
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
            else:
                return

    async def stop(self) -> None:
        """Stop the sweeper, close the provider and the database; once per start."""
        if not self._opened:
            return
        self._opened = False
        self.started = False
        if self.recovery is not None:  # before the database it sweeps closes
            await self.recovery.stop()
            self.recovery = None
        self.provider.close()
        await self.db.close()

    # --- endpoints -------------------------------------------------------------------------

    async def create_payment(self, request: Request) -> StarletteResponse:
        try:
            payment = parse_payment(await self.idempotent.body(request))
        except (InvalidRequest, InvalidBody) as exc:
            return invalid(request, exc)
        principal = request.user.identity

        async def charge(attempt: Phases) -> Response:
            crash_point("after_claim")  # TEST-ONLY: off unless IDEMFLOW_DEMO_CRASH_AT is set
            return await self.payments.create(attempt, principal, payment)

        response = await self.idempotent.run(request, charge)
        if response.status_code in (201, 402) and "idempotent-replayed" not in response.headers:
            crash_point("after_commit")  # TEST-ONLY: committed, not yet sent
        return response

    async def create_payment_unprotected(self, request: Request) -> StarletteResponse:
        """Benchmark only: the same business write, idempotency switched off."""
        try:
            payment = parse_payment(await request.body())
        except InvalidRequest as exc:
            return invalid(request, exc)
        principal = request.user.identity
        async with pooled_transaction(self.db.connect, self.db.transaction) as transaction:
            attempt = PlainAttempt(transaction)
            await transaction.begin()
            try:
                response = await self.payments.create(attempt, principal, payment)
            except BaseException:
                await transaction.rollback()
                raise
            await (transaction.commit() if response.status < 500 else transaction.rollback())
        return to_starlette(response)

    async def create_refund(self, request: Request) -> StarletteResponse:
        try:
            refund = parse_refund(await self.idempotent.body(request))
        except (InvalidRequest, InvalidBody) as exc:
            return invalid(request, exc)
        principal = request.user.identity
        payment_id = request.path_params["id"]
        if await self.payments.get(principal, payment_id) is None:
            return not_found(request, payment_id)

        async def refund_once(attempt: Phases) -> Response:
            return await self.payments.refund(attempt, principal, payment_id, refund)

        return await self.idempotent.run(request, refund_once)

    async def list_payments(self, request: Request) -> StarletteResponse:
        rows = await self.payments.list(request.user.identity, query_limit(request))
        return to_starlette(Response.json(200, {"payments": [payment_json(r) for r in rows]}))

    async def get_payment(self, request: Request) -> StarletteResponse:
        payment_id = request.path_params["id"]
        row = await self.payments.get(request.user.identity, payment_id)
        if row is None:
            return not_found(request, payment_id)
        return to_starlette(Response.json(200, payment_json(row)))

    async def provider_charges(self, request: Request) -> StarletteResponse:
        ledger = await self.provider.ledger(query_limit(request, default=1000))
        charges = [charge.as_json() for charge in ledger]
        return to_starlette(Response.json(200, {"charges": charges}))

    async def metrics_text(self, request: Request) -> StarletteResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # In a thread: the stuck-claims gauge runs a (cached) COUNT at scrape time.
        body = await asyncio.to_thread(generate_latest, self.metrics.registry)
        return StarletteResponse(body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: Request) -> StarletteResponse:
        """200 once the key store answers a read, on the gauge's connection of its own.

        Not on a connection of the requests' pool: a pool every request holds
        (a herd of retries after a restart, a slow provider call) would queue the
        probe behind them, and a supervisor would take a service that is up (and
        answers its excess 503 + ``Retry-After``) for one that is down.
        """
        if self._side_store is None:
            raise StoreUnavailable("the demo has not started")
        await asyncio.to_thread(self._side_store.get, HEALTH_PRINCIPAL, HEALTH_KEY)
        return to_starlette(Response.json(200, {"status": "ok"}))

    def routes(self) -> list[Route]:
        routes = [
            Route("/payments", self.create_payment, methods=["POST"]),
            Route("/payments", self.list_payments, methods=["GET"]),
            Route("/payments/{id}", self.get_payment, methods=["GET"]),
            Route("/payments/{id}/refunds", self.create_refund, methods=["POST"]),
            Route("/provider/charges", self.provider_charges, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]
        if self.settings.bench_routes:
            routes.append(
                Route("/_bench/payments", self.create_payment_unprotected, methods=["POST"])
            )
        return routes


class PlainAttempt:
    """The phases without idempotency (benchmark only): commit, and a fresh key each call."""

    recovery_point: str | None = None

    def __init__(self, transaction: Any) -> None:
        self._transaction = transaction

    @property
    def connection(self) -> Any:
        return self._transaction.connection

    def downstream_key(self, step: str) -> str:
        import uuid

        return f"plain-{step}-{uuid.uuid4().hex}"

    async def commit_phase(self, recovery_point: str) -> None:
        await self._transaction.commit()
        await self._transaction.begin()


class InvalidQuery(HTTPException):
    """A query parameter that is not what the endpoint reads: 400 ``invalid-query``."""

    slug = "invalid-query"
    title = "Invalid query parameter"

    def __init__(self, detail: str) -> None:
        super().__init__(400, detail)


# A count longer than this is no count a client means (and int() of 5,000
# digits raises): refused before it is converted.
_MAX_LIMIT_DIGITS = 9


def query_limit(request: Request, default: int = 100, maximum: int = 100_000) -> int:
    """``?limit=N`` on the list endpoints (at most ``maximum``), else ``default``.

    N is 1 or more, in ASCII digits: ``str.isdigit`` is also true of ``²`` and
    ``①``, which ``int()`` refuses. Anything else is a 400, not a default.
    """
    text = request.query_params.get("limit")
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_LIMIT_DIGITS or int(text) < 1:
        raise InvalidQuery(f"limit must be a whole number from 1 to {maximum} (ASCII digits)")
    return min(int(text), maximum)


def invalid(request: Request, exc: InvalidRequest | InvalidBody) -> StarletteResponse:
    """400 for a body the endpoint refuses; the library's own problem (413, …) for one it does."""
    rid = request_id(request.scope)
    if isinstance(exc, InvalidBody):  # over the cap, or cut short by a disconnect
        return to_starlette(problem_for(exc, rid))
    return to_starlette(
        problem(400, "Invalid request body", str(exc), slug="invalid-body", request_id=rid)
    )


def not_found(request: Request, payment_id: str) -> StarletteResponse:
    detail = f"no payment {payment_id!r} for this principal"
    return to_starlette(
        problem(404, "Not found", detail, slug="not-found", request_id=request_id(request.scope))
    )


_HTTP_TITLES = {404: "Not found", 405: "Method not allowed"}


async def http_error(request: Request, exc: Exception) -> StarletteResponse:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    title = getattr(exc, "title", None) or _HTTP_TITLES.get(status, "Error")
    slug = getattr(exc, "slug", None) or title.lower().replace(" ", "-")
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    response = problem(status, title, str(detail), slug=slug, request_id=request_id(request.scope))
    result = to_starlette(response)
    if isinstance(exc, HTTPException) and exc.headers:
        result.headers.update(exc.headers)
    return result


async def server_error(request: Request, exc: Exception) -> StarletteResponse:
    if _outage(exc):
        # Pool exhausted, server gone, SQLite locked past its busy timeout, the key
        # store's own (/healthz's probe): an outage the client should retry (the
        # claim was released), not a bug.
        outage = (
            exc
            if isinstance(exc, StoreUnavailable)
            else StoreUnavailable(f"the payments database is unavailable: {type(exc).__name__}")
        )
        return to_starlette(problem_for(outage, request_id(request.scope)))
    print(f"idemflow demo: unhandled {type(exc).__name__}: {exc}", file=sys.stderr)
    response = problem(
        500,
        "Internal server error",
        "the request failed; it was not recorded",
        slug="internal-error",
        request_id=request_id(request.scope),
    )
    return to_starlette(response)


def _outage(exc: BaseException) -> bool:
    return isinstance(exc, StoreUnavailable) or database_unavailable(exc)


def database_unavailable(exc: BaseException) -> bool:
    """Is ``exc`` a database outage (any backend) rather than a bug?"""
    if sqlite_unavailable(exc):
        return True
    try:
        if postgres_unavailable(exc):
            return True
    except ImportError:  # psycopg not installed: it cannot be a PostgreSQL error
        pass
    return mysql_unavailable(exc) or redis_unavailable(exc)


def mysql_unavailable(exc: BaseException) -> bool:
    """MySQL's rules (``idemflow.stores.mysql.is_unavailable``), and a socket asyncmy
    lets through unwrapped: reset, broken pipe, or the stream cut mid-reply."""
    from idemflow.stores.mysql import is_unavailable

    return is_unavailable(exc) or isinstance(exc, ConnectionError | asyncio.IncompleteReadError)


def redis_unavailable(exc: BaseException) -> bool:
    try:
        from idemflow.stores.redis import is_unavailable
    except ImportError:  # redis-py not installed: it cannot be a Redis error
        return False
    return is_unavailable(exc)


def create_app(service: DemoService | Settings) -> Starlette:
    """The demo app. A service not yet started is started (and stopped) by the app's lifespan."""
    if isinstance(service, Settings):
        service = DemoService(service)
    owner = service

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started_here = not owner.started
        if started_here:
            await owner.start()
        try:
            yield
        finally:
            if started_here:
                await owner.stop()

    app = Starlette(
        routes=service.routes(),
        middleware=[
            Middleware(RequestIdMiddleware),
            Middleware(BearerAuth, tokens=service.settings.tokens),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.service = service
    return app
