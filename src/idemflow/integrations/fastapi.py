"""idemflow for FastAPI, transactional mode: `IdempotentRoute` runs every endpoint taking
an `IdempotentRequest` (made by `dependency`) whole inside the claim, in the transaction
the completion is written in. See docs/frameworks/fastapi.md."""

# No ``from __future__ import annotations`` here: FastAPI reads the
# dependency's signature at runtime, including names from this closure.

import contextlib
import copy
import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, Generic, cast

from .. import AsyncAttempt, AsyncIdempotency, Observer
from .._errors import ConfigurationError, IdempotencyError, MissingPrincipal
from .._extras import optional
from .._model import Policy, Response, Verdict
from ..edge import (
    KEY_HEADER,
    SAFE_METHODS,
    AsyncEdge,
    EdgeOptions,
    RoutePolicy,
    async_engine_store,
    header_values,
    policy_for,
    problem_for,
)
from ..edge import async_pooled_transaction as pooled_transaction
from ._openapi import operation

# fastapi first: without it, the hint names the fastapi extra (starlette comes with it).
with optional("idemflow.integrations.fastapi"):
    from fastapi import Depends, Request
    from fastapi.datastructures import DefaultPlaceholder
    from fastapi.routing import APIRoute, serialize_response
    from fastapi.utils import deep_dict_update, is_body_allowed_for_status_code
    from starlette.responses import Response as StarletteResponse
    from starlette.types import Receive, Scope, Send
    from typing_extensions import TypeVar  # fastapi's own dependency: a TypeVar's default

    from .asgi import _read_body, _replaying, authenticated_user, request_id, send_response
    from .starlette import (
        Idempotent,
        StarletteHandler,
        _declares_streaming,
        effective_route,
        not_a_response,
        to_starlette,
    )

__all__ = ["EdgeOptions", "IdempotentRequest", "IdempotentRoute", "dependency", "scope_user"]

#: What ``idem.connection`` is: the ``AsyncSession`` of a SQLAlchemy engine, psycopg's
#: ``AsyncConnection`` of a pool; unsaid (``IdempotentRequest``), Any.
Connection = TypeVar("Connection", default=Any)

# The attribute marking a callable returned by dependency(), for the route class.
_MARK = "__idemflow_protection__"


@dataclass(frozen=True, slots=True)
class _Protection:
    idempotent: Idempotent
    required: bool


class IdempotentRequest(Generic[Connection]):
    """One request's handle on transactional idempotency.

    Under `IdempotentRoute` the endpoint runs protected: write on `connection` (of the
    type given, ``IdempotentRequest[AsyncSession]``). Otherwise call `run` with a handler.
    """

    def __init__(
        self,
        idempotent: Idempotent,
        request: Request,
        principal: str | None,
        *,
        required: bool = True,
    ) -> None:
        self._idempotent = idempotent
        self._request = request
        #: None: read it from the scope; "": the auth dependency found nobody (401).
        self._principal = principal
        self._required = required
        self._attempt: AsyncAttempt | None = None
        self._plain: Any = None  # the transaction of an unprotected run

    @property
    def key_sent(self) -> bool:
        """Whether the request carries an ``Idempotency-Key`` header."""
        return bool(header_values(self._request.headers.raw, KEY_HEADER))

    @property
    def attempt(self) -> AsyncAttempt | None:
        """The claimed attempt (checkpoints, downstream keys); None in an unprotected run."""
        if self._attempt is None and self._plain is None:
            raise RuntimeError("there is no attempt outside the protected endpoint's run")
        return self._attempt

    @property
    def connection(self) -> Connection:
        """The connection (or session) of the transaction the completion is written in."""
        if self._attempt is not None:
            return cast(Connection, self._attempt.connection)
        if self._plain is not None:
            return cast(Connection, self._plain.connection)
        msg = (
            "idem.connection exists only while the endpoint runs protected: declare the "
            "route with route_class=IdempotentRoute (or use idem.run(handler))"
        )
        raise RuntimeError(msg)

    async def run(self, handler: StarletteHandler) -> StarletteResponse:
        """Run ``handler`` once per key in the endpoint's transaction, or replay, or refuse."""
        if self._attempt is not None:  # IdempotentRoute already protects this endpoint
            return _as_starlette(await handler(self._attempt))
        if self._plain is not None:
            msg = "idem.run needs an Idempotency-Key: without one, write on idem.connection"
            raise ConfigurationError(msg)
        return await self._idempotent.run(self._request, handler, principal=self._principal)

    async def _protect(self, call: Callable[[], Awaitable[StarletteResponse]]) -> StarletteResponse:
        """Run the endpoint (``call``) protected; plainly if its key is optional and absent."""
        if not self._required and not self.key_sent:
            if not self._principal and not self._idempotent.edge.options.public:
                refusal = MissingPrincipal("authenticate first: this endpoint is not public")
                return to_starlette(problem_for(refusal, request_id(self._request.scope)))
            return await self._unprotected(call)

        async def handler(attempt: AsyncAttempt) -> StarletteResponse:
            self._attempt = attempt
            try:
                return await call()
            finally:
                self._attempt = None

        return await self._idempotent.run(self._request, handler, principal=self._principal)

    async def _unprotected(
        self, call: Callable[[], Awaitable[StarletteResponse]]
    ) -> StarletteResponse:
        """No key, none required: run once in a transaction of its own, rolled back on a
        transient answer as in a protected run."""
        idempotent = self._idempotent
        async with pooled_transaction(idempotent._connect, idempotent._transaction) as plain:
            await plain.begin()
            self._plain = plain
            try:
                response = await call()
            except BaseException:
                # The endpoint's own exception propagates, even if the rollback fails.
                with contextlib.suppress(Exception):
                    await plain.rollback()
                raise
            finally:
                self._plain = None
            edge = idempotent.edge
            policy = policy_for(edge.options, self._principal or "") or edge.idempotency.policy
            verdict = policy.verdict(Response(response.status_code, b"", ()))
            if verdict is Verdict.TRANSIENT:
                await plain.rollback()
            else:
                await plain.commit()
            return response


def dependency(
    idempotent: Any,
    *,
    principal: Callable[..., Any] | None = None,
    required: bool = True,
    policy: RoutePolicy | None = None,
    options: EdgeOptions | None = None,
    observer: Observer | None = None,
) -> Callable[..., Any]:
    """A FastAPI dependency yielding `IdempotentRequest`.

    Args:
        idempotent: an [`Idempotent`][idemflow.integrations.starlette.Idempotent], or the
            app's own database: a SQLAlchemy ``AsyncEngine`` or ``async_sessionmaker``
            (PostgreSQL through psycopg, or a SQLite file; ``idem.connection`` is the
            ``AsyncSession``) or a ``psycopg_pool.AsyncConnectionPool`` of autocommit
            connections. Keys then live in that database (``idemflow_keys``), with
            ``policy``, ``options`` and ``observer`` as given.
        principal: your authentication dependency; what it returns (a ``str``, or an
            object with ``identity`` or ``username``; None: 401) scopes the key. For
            starlette's ``AuthenticationMiddleware`` pass `scope_user`. Only a ``public``
            endpoint (``EdgeOptions(public=True)``) may omit it.
        policy: this route's [`Policy`][idemflow.Policy], or ``(principal) -> Policy``;
            with an ``Idempotent``, its stale threshold may not exceed the driver's.
        required: whether a request must carry an ``Idempotency-Key``; with False,
            one without runs unprotected, once, in a transaction of its own.
    """
    if not isinstance(idempotent, Idempotent):
        app_policy = policy if isinstance(policy, Policy) else None
        idempotent = _on_shorthand(idempotent, app_policy, options, observer)
    elif options is not None or observer is not None:
        msg = "options= and observer= belong to the Idempotent given"
        raise ConfigurationError(msg)
    if policy is not None and policy is not idempotent.edge.idempotency.policy:
        idempotent = _for_route(idempotent, policy)
    public = idempotent.edge.options.public
    if principal is None and not public:
        msg = (
            "dependency() needs principal=<your authentication dependency> (keys are "
            "scoped to the caller); with starlette's AuthenticationMiddleware pass "
            "principal=scope_user; a deliberately public endpoint sets EdgeOptions(public=True)"
        )
        raise ConfigurationError(msg)
    protection = _Protection(idempotent, required)

    if principal is None:

        async def anonymous(request: Request) -> IdempotentRequest:
            return IdempotentRequest(idempotent, request, "", required=required)

        setattr(anonymous, _MARK, protection)
        return anonymous

    async def from_dependency(
        request: Request, who: Annotated[Any, Depends(principal)]
    ) -> IdempotentRequest:
        return IdempotentRequest(idempotent, request, principal_name(who) or "", required=required)

    setattr(from_dependency, _MARK, protection)
    return from_dependency


def _for_route(idempotent: Idempotent, policy: RoutePolicy) -> Idempotent:
    route = copy.copy(idempotent)
    options = replace(idempotent.edge.options, policy=policy)
    route.edge = AsyncEdge(idempotent.edge.idempotency, options)
    return route


def _on_shorthand(
    given: Any, policy: Policy | None, options: EdgeOptions | None, observer: Observer | None
) -> Idempotent:
    """The transactional configuration for the app's own database: keys and rows in one."""
    module = type(given).__module__
    if module.startswith("sqlalchemy"):
        store, connect, transaction = _on_sqlalchemy(given, policy)
    elif module.startswith("psycopg_pool") and type(given).__name__ == "AsyncConnectionPool":
        from ..stores.postgres import AsyncPostgresStore
        from ..transactions import AsyncPsycopgTransaction

        store = AsyncPostgresStore(given)
        # The pool's, never one the server closed (a restart).
        connect, transaction = store.connection, AsyncPsycopgTransaction
    else:
        msg = (
            "dependency() takes a SQLAlchemy AsyncEngine or async_sessionmaker, a "
            f"psycopg_pool.AsyncConnectionPool or an Idempotent, not {type(given).__name__}"
        )
        raise TypeError(msg)
    driver = AsyncIdempotency(store, policy)
    if observer is not None:
        driver.observer = observer
    return Idempotent(driver, connect=connect, transaction=transaction, options=options)


def _on_sqlalchemy(sessions: Any, policy: Policy | None) -> tuple[Any, Any, Any]:
    """The store (claiming on the engine's own pool, or the SQLite file), the sessions and
    their adapter for an ``AsyncEngine`` or ``async_sessionmaker``."""
    with optional("idemflow.integrations.fastapi"):
        from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

    from ..transactions import AsyncSQLAlchemyTransaction

    if isinstance(sessions, AsyncEngine):
        sessions = async_sessionmaker(sessions)
    engine = sessions.kw.get("bind") if isinstance(sessions, async_sessionmaker) else None
    if not isinstance(engine, AsyncEngine):
        msg = "dependency() takes an AsyncEngine or an async_sessionmaker bound to one"
        raise ConfigurationError(msg)
    return async_engine_store(engine, "idemflow_keys", policy), sessions, AsyncSQLAlchemyTransaction


def scope_user(request: Request) -> str | None:
    """A principal dependency reading ``request.user`` (starlette's authentication)."""
    return authenticated_user(request.scope)


def principal_name(who: Any) -> str | None:
    """What an auth dependency returned, as the principal that scopes keys."""
    if who is None or isinstance(who, str):
        return who or None
    for attribute in ("identity", "username"):
        value = getattr(who, attribute, None)
        if isinstance(value, str):
            return value
    msg = f"the principal dependency returned {type(who).__name__}; return a str (or None)"
    raise ConfigurationError(msg)


class IdempotentRoute(APIRoute):
    """An ``APIRoute`` that protects endpoints taking an `IdempotentRequest` parameter
    (``APIRouter(route_class=IdempotentRoute)``); others are ordinary routes."""

    #: What protects this route (None: an ordinary route).
    protection: _Protection | None = None

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        found = _protected_parameter(self)
        if found is None:
            return
        name, protection = found
        _refuse_misconfigured(self, endpoint)
        self.protection = protection
        extra = operation(
            _success_status(self), required=protection.required, also_422="Validation Error"
        )
        if kwargs.get("openapi_extra"):
            deep_dict_update(extra, kwargs["openapi_extra"])  # the route's own words win
        kwargs["openapi_extra"] = extra
        # Built again around the endpoint, so the whole endpoint runs protected.
        super().__init__(path, _protected(endpoint, name, self), **kwargs)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body whole and bounded before FastAPI does, then handle as usual."""
        if self.protection is None or scope.get("method") not in (self.methods or ()):
            await super().handle(scope, receive, send)
            return
        limit = self.protection.idempotent.edge.options.max_body_bytes
        try:
            body = await _read_body(receive, scope, limit)
        except IdempotencyError as exc:
            await send_response(send, problem_for(exc, request_id(scope)))
            return
        await super().handle(scope, _replaying(body, receive), send)


def _protected_parameter(route: APIRoute) -> tuple[str, _Protection] | None:
    found: list[tuple[str | None, _Protection]] = []
    for dependant in route.dependant.dependencies:
        protection = getattr(dependant.call, _MARK, None)
        if isinstance(protection, _Protection):
            found.append((dependant.name, protection))
    if not found:
        return None
    name, protection = found[0]
    if len(found) > 1 or name is None:
        msg = (
            f"{_label(route)}: declare the idemflow dependency once, as a parameter of the "
            "endpoint (idem: Idem), not in dependencies=[...]"
        )
        raise ConfigurationError(msg)
    return name, protection


def _refuse_misconfigured(route: APIRoute, endpoint: Callable[..., Any]) -> None:
    """What would fail every request instead fails now, naming the route."""
    safe = sorted((route.methods or set()) & SAFE_METHODS)
    if safe:
        msg = (
            f"{_label(route)} is protected by idemflow, but {', '.join(safe)} is idempotent "
            "already; protect unsafe methods only"
        )
        raise ConfigurationError(msg)
    why = _declares_streaming(route)
    if why is not None:
        msg = f"{_label(route)} is protected by idemflow but {why}: it cannot be stored for replay"
        raise ConfigurationError(msg)
    if not inspect.iscoroutinefunction(inspect.unwrap(endpoint)):
        msg = (
            f"{_label(route)} is protected by idemflow but its endpoint is not 'async def': "
            "it writes on idem.connection, an async connection"
        )
        raise ConfigurationError(msg)


def _label(route: APIRoute) -> str:
    return f"{'/'.join(sorted(route.methods or ()))} {route.path}"


def _protected(
    endpoint: Callable[..., Any], name: str, route: APIRoute
) -> Callable[..., Awaitable[StarletteResponse]]:
    """``endpoint``, run whole inside the claim, its return value rendered there by FastAPI."""

    @functools.wraps(endpoint)
    async def protected(**values: Any) -> StarletteResponse:
        idem: IdempotentRequest = values[name]

        async def call() -> StarletteResponse:
            result = await endpoint(**values)
            return await _rendered(route, idem._request.scope, result, values)

        return await idem._protect(call)

    return protected


async def _rendered(
    route: APIRoute, scope: Scope, result: Any, values: dict[str, Any]
) -> StarletteResponse:
    """What FastAPI would send for ``result``: response_model, status_code, response_class."""
    if isinstance(result, StarletteResponse | Response):
        return _as_starlette(result)
    serving = effective_route(route, scope)
    content = await serialize_response(
        field=serving.response_field,
        response_content=result,
        include=serving.response_model_include,
        exclude=serving.response_model_exclude,
        by_alias=serving.response_model_by_alias,
        exclude_unset=serving.response_model_exclude_unset,
        exclude_defaults=serving.response_model_exclude_defaults,
        exclude_none=serving.response_model_exclude_none,
    )
    # A ``response: Response`` parameter's status and headers apply, as in FastAPI.
    sub = next((v for v in values.values() if isinstance(v, StarletteResponse)), None)
    status = serving.status_code
    if sub is not None and sub.status_code:
        status = sub.status_code
    response_class: Any = serving.response_class
    if isinstance(response_class, DefaultPlaceholder):
        response_class = response_class.value
    response: StarletteResponse = response_class(
        content, **({"status_code": status} if status else {})
    )
    if not is_body_allowed_for_status_code(response.status_code):
        response.body = b""
    if sub is not None:
        response.raw_headers.extend(sub.headers.raw)
    return response


def _as_starlette(result: Any) -> StarletteResponse:
    if isinstance(result, StarletteResponse):
        return result
    if isinstance(result, Response):
        return to_starlette(result)
    raise not_a_response(result)


def _success_status(route: APIRoute) -> str:
    """The status FastAPI documents the success under: ``status_code``, or the class's default."""
    if route.status_code is not None:
        return str(route.status_code)
    response_class: Any = route.response_class
    if isinstance(response_class, DefaultPlaceholder):
        response_class = response_class.value
    default = inspect.signature(response_class.__init__).parameters.get("status_code")
    return (
        str(default.default) if default is not None and isinstance(default.default, int) else "200"
    )
